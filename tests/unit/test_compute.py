"""The compute dtype chosen from the hardware (eagle3pipe/base/compute.py): bf16 where it is native, float32 elsewhere,
fed the flag sets real machines report (no model, no torch)."""
import pytest

from eagle3pipe.base import compute, devices


# /proc/cpuinfo lines as real machines print them (trimmed to the flags that matter and a few around them)
EPYC_AVX2 = "flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni clzero\n"
EPYC_AVX512_BF16 = ("flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 "
                    "avx512_vnni\n")
XEON_AMX = "flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
XEON_AVX512_ONLY = "flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni\n"
GRAVITON3 = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid sve i8mm bf16 svebf16\n"
GRAVITON2 = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop\n"


def flags_of(tmp_path, text):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: some CPU\n" + text + "\nprocessor\t: 1\n" + text)
    return compute.cpu_flags(str(path))


@pytest.mark.parametrize("text,dtype,why", [
    (EPYC_AVX2, "float32", "CPU without native bf16 (AVX2, no avx512_bf16/amx_bf16/bf16): float32"),
    (XEON_AVX512_ONLY, "float32", "CPU without native bf16 (AVX-512"),
    (GRAVITON2, "float32", "CPU without native bf16"),
    (EPYC_AVX512_BF16, "bfloat16", "CPU with native bf16: avx512_bf16"),
    (XEON_AMX, "bfloat16", "CPU with native bf16: amx_bf16, avx512_bf16"),
    (GRAVITON3, "bfloat16", "CPU with native bf16: bf16"),
])
def test_auto_follows_the_cpu_flags(tmp_path, text, dtype, why):
    c = compute.resolve("auto", on_gpu=False, flags=flags_of(tmp_path, text), env={})
    assert c.dtype == dtype and c.reason.startswith(why) and c.warning is None
    assert c.describe() == f"compute dtype: {dtype} ({c.reason})"


def test_gpus_compute_in_bf16_whatever_the_host_cpu(tmp_path):
    c = compute.resolve("auto", on_gpu=True, flags=flags_of(tmp_path, EPYC_AVX2), env={})
    assert (c.dtype, c.reason, c.warning) == ("bfloat16", "GPU", None)
    assert compute.resolve("float32", on_gpu=True).dtype == "float32"


def test_explicit_bf16_without_native_bf16_runs_with_one_warning(tmp_path):
    c = compute.resolve("bfloat16", on_gpu=False, flags=flags_of(tmp_path, EPYC_AVX2), env={})
    assert c.dtype == "bfloat16"
    assert "\n" not in c.warning and "emulate bf16" in c.warning and "3-4x slower than float32" in c.warning
    # where it is native the explicit choice costs nothing: no warning
    assert compute.resolve("bfloat16", on_gpu=False, flags=flags_of(tmp_path, XEON_AMX), env={}).warning is None


def test_explicit_float32_is_kept_and_says_what_auto_would_do(tmp_path):
    c = compute.resolve("float32", on_gpu=False, flags=flags_of(tmp_path, EPYC_AVX512_BF16), env={})
    assert c.dtype == "float32" and "--dtype auto would use it" in c.reason and c.warning is None
    c = compute.resolve("float32", on_gpu=False, flags=flags_of(tmp_path, EPYC_AVX2), env={})
    assert c.reason == "--dtype float32"


def test_kernels_held_below_bf16_count_as_no_native_bf16(tmp_path):
    """ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA caps make torch emulate bf16 on a CPU that has it: float32 then."""
    flags = flags_of(tmp_path, EPYC_AVX512_BF16)
    for env in ({"ATEN_CPU_CAPABILITY": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"ATEN_CPU_CAPABILITY": "default"}):
        c = compute.resolve("auto", on_gpu=False, flags=flags, env=env)
        assert c.dtype == "float32" and f"{next(iter(env))}=" in c.reason, c
    for env in ({}, {"ATEN_CPU_CAPABILITY": "avx512"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}):
        assert compute.resolve("auto", on_gpu=False, flags=flags, env=env).dtype == "bfloat16"


def test_unreadable_cpuinfo_means_no_native_bf16(tmp_path):
    assert compute.cpu_flags(str(tmp_path / "missing")) == set()  # Linux; macOS asks sysctl instead
    assert compute.resolve("auto", on_gpu=False, flags=set(), env={}).dtype == "float32"


def test_memory_of_weights_loaded_in_float32():
    # a bf16 checkpoint doubles in float32; a float32 checkpoint or an unknown (quantized) dtype keeps its size
    assert compute.loaded_weights_bytes(100, "bfloat16", "float32") == 200
    assert compute.loaded_weights_bytes(100, "bfloat16", "bfloat16") == 100
    assert compute.loaded_weights_bytes(100, "float32", "float32") == 100
    assert compute.loaded_weights_bytes(100, None, "float32") == 100
    assert compute.loaded_weights_bytes(None, "bfloat16", "float32") is None


def test_vllm_cpu_threads_bind_to_the_affinity():
    """vLLM-CPU's OpenMP threads bind to the CPUs this process may run on (its affinity: a taskset), in the variable's
    own form: runs as "a-b", joined by commas."""
    import os
    from eagle3pipe.engines import engine
    before = os.sched_getaffinity(0)
    ids = sorted(before)
    try:
        os.sched_setaffinity(0, {ids[-1]})  # a taskset to the last CPU: binding "0-..." would be outside it
        assert devices.cpu_list() == str(ids[-1])
        env = {}
        engine.cpu_vllm_env(env)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(ids[-1])
    finally:
        os.sched_setaffinity(0, before)
    expand = lambda text: [i for part in text.split(",") for i in  # noqa: E731
                           range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)]
    assert expand(devices.cpu_list()) == ids
