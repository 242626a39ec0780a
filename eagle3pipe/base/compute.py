"""The compute dtype, chosen from the hardware (`--dtype auto|bfloat16|float32`, default auto).

`auto` computes in bf16 where the hardware has it natively: NVIDIA GPUs, x86 CPUs with `avx512_bf16` or `amx_bf16`,
Arm CPUs with the bf16 extension. Elsewhere (AVX2-only x86: most laptops, desktops and many cloud VMs) torch and
vLLM emulate bf16, and float32 is the faster choice: 4.3x on a 2-core AVX2 EPYC for one SmolLM2 forward, 3.0x with
torch held to AVX2 kernels on an AVX-512 machine (docs/BENCHMARKS.md). The CPU's features come from what the OS
reports (/proc/cpuinfo's flags or Features line; sysctl on macOS), never from the vendor's name.

Stored formats do not depend on it: hidden-state files stay bf16 (or fp8), rounded from the float32 result where that
is the compute dtype; checkpoints stay speculators' bf16. Manifests record the compute dtype. No torch import here:
the preflight calls this before anything heavy loads.
"""
import dataclasses
import os
import platform
import subprocess
from typing import Optional

from .devices import visible_gpus

CHOICES = ("auto", "bfloat16", "float32")
# the features that mean bf16 arithmetic in hardware, as /proc/cpuinfo names them (x86 flags, Arm Features)
NATIVE_BF16 = ("avx512_bf16", "amx_bf16", "bf16")
# measured (docs/BENCHMARKS.md): one SmolLM2-135M forward, bf16 against float32, on CPUs without native bf16
EMULATION_COST = "3-4x slower than float32"


@dataclasses.dataclass(frozen=True)
class Compute:
    dtype: str                # "bfloat16" or "float32": what the model computes in
    reason: str               # one phrase, printed beside it
    warning: Optional[str]    # an explicit choice that costs speed here

    def describe(self):
        return f"compute dtype: {self.dtype} ({self.reason})"

    def torch(self):
        import torch
        return getattr(torch, self.dtype)


def cpu_flags(cpuinfo="/proc/cpuinfo"):
    """The CPU features the OS reports: the union of /proc/cpuinfo's `flags` (x86) and `Features` (Arm) lines; on
    macOS, "bf16" when sysctl says FEAT_BF16. An empty set when nothing can be read."""
    flags = set()
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    flags.update(value.split())
    except OSError:
        pass
    if not flags and platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                                 timeout=5)
            if out.stdout.strip() == "1":
                flags.add("bf16")
        except (OSError, subprocess.TimeoutExpired):
            pass
    return flags


# oneDNN's ISA caps without bf16 instructions (ONEDNN_MAX_CPU_ISA)
ONEDNN_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def kernel_cap(env):
    """Why torch will not use the CPU's bf16 instructions although the CPU has them, or None: the operator held its
    kernels below them (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, as torch documents), so bf16 is emulated."""
    aten, onednn = env.get("ATEN_CPU_CAPABILITY", "").strip().lower(), env.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if aten and not aten.startswith("avx512"):
        return f"ATEN_CPU_CAPABILITY={aten}"
    if onednn in ONEDNN_WITHOUT_BF16:
        return f"ONEDNN_MAX_CPU_ISA={onednn}"
    return None


def native_bf16(flags, env=None):
    """The feature names among `flags` that give native bf16 arithmetic (empty: none, or torch held below them by
    `env`)."""
    return [] if env is not None and kernel_cap(env) else sorted(set(flags) & set(NATIVE_BF16))


def isa(flags):
    """The widest x86 vector ISA among `flags`, for messages ("AVX-512", "AVX2", ...); the machine name otherwise."""
    for name, flag in (("AMX", "amx_tile"), ("AVX-512", "avx512f"), ("AVX2", "avx2"), ("AVX", "avx")):
        if flag in flags:
            return name
    return platform.machine() or "unknown"


def resolve(requested, on_gpu, flags=None, env=None):
    """The compute dtype for `requested` (one of CHOICES) on a GPU or this CPU (`flags`: cpu_flags() by default;
    `env`: this process's environment, whose kernel caps count, by default)."""
    if on_gpu:
        if requested == "float32":
            return Compute("float32", "--dtype float32 on GPU: bf16 is native there and about 2x faster", None)
        return Compute("bfloat16", "GPU" if requested == "auto" else "--dtype bfloat16", None)
    env = os.environ if env is None else env
    flags = cpu_flags() if flags is None else set(flags)
    native = native_bf16(flags, env)
    if requested == "float32":
        note = f"; this CPU has native bf16 ({', '.join(native)}): --dtype auto would use it" if native else ""
        return Compute("float32", "--dtype float32" + note, None)
    if native:
        return Compute("bfloat16", f"CPU with native bf16: {', '.join(native)}" if requested == "auto"
                       else "--dtype bfloat16", None)
    cap = kernel_cap(env)
    without = (f"CPU without native bf16 ({isa(flags)}, no {'/'.join(NATIVE_BF16)})" if not cap else
               f"torch held below the CPU's bf16 kernels by {cap}")
    if requested == "auto":
        return Compute("float32", f"{without}: float32", None)
    return Compute("bfloat16", f"--dtype bfloat16 on a {without}",
                   f"--dtype bfloat16 on a {without}: torch and vLLM emulate bf16 here, {EMULATION_COST}; "
                   f"--dtype auto would choose float32 (stored files are bf16 either way)")


def for_cpu_or_gpu(requested, device="auto"):
    """resolve() for a stage whose device is `device` (auto|cpu|cuda), without importing torch: a GPU when asked for or
    when nvidia-smi sees one."""
    on_gpu = device == "cuda" or (device == "auto" and bool(visible_gpus()))
    return resolve(requested, on_gpu)


def value_bytes(dtype):
    return 4 if dtype == "float32" else 2


def stored_dtype_bytes(torch_dtype):
    """Bytes per weight a checkpoint's config `torch_dtype` says it stores (None: unknown or quantized)."""
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(torch_dtype or "").replace("torch.", ""))


def loaded_weights_bytes(stored_bytes, torch_dtype, dtype):
    """The memory the verifier's weights take once loaded in `dtype`: a bf16 checkpoint doubles in float32 (a quantized
    or unknown one counts as stored)."""
    per = stored_dtype_bytes(torch_dtype)
    if stored_bytes is None or per is None:
        return stored_bytes
    return stored_bytes * value_bytes(dtype) // per


def has_amx():
    return "amx_tile" in cpu_flags()


if __name__ == "__main__":  # `python -m eagle3pipe.base.compute`: what auto chooses on this machine
    print(for_cpu_or_gpu("auto").describe())
