"""Benchmark: every stage that runs a model, computing in bf16 and in float32, on this CPU, through the real stage
commands (issue 22). Side by side in one script, so the ratio is what counts, not the absolute numbers.

    python -m bench.bench_dtype_cpu --work /tmp/bd [--samples 40] [--avx2]

--avx2 holds torch to AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2),
the closest this machine gets to a CPU without native bf16: it covers torch's own matmuls, attention and
elementwise kernels (the HF backend, training), not vLLM's C++ CPU kernels, which choose their ISA from the CPU's
flags (vllm._C with avx512_bf16) whatever these variables say.

Measured per dtype: stage 02 (vLLM and HF backends: the manifest's tokens/s, which excludes the model load), stage 04
(median tokens/s of steps 4 and later, 2,048-token packed steps), stage 05 (output tokens/s at batch size 1, without
and with the draft; stage 01's --regenerate runs the same engine's generation). Prints one RESULT line (JSON) with
the CPU's model and flags.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from bench.common import REPO, result
MODEL = os.path.join(REPO, "data", "models", "smollm2-135m-instruct")
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def run(args, log, env):
    t = time.time()
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    if p.returncode:
        print(open(log).read()[-3000:])
        raise SystemExit(f"{args[0]} failed ({p.returncode}); log {log}")
    return time.time() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--avx2", action="store_true")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    a = ap.parse_args()
    from eagle3pipe.base import compute
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(AVX2 if a.avx2 else {}))
    w = os.path.abspath(a.work)
    os.makedirs(w, exist_ok=True)
    prep, voc = f"{w}/prepared", f"{w}/vocab"
    if not os.path.exists(f"{prep}/manifest.json"):
        run(["01_prepare_dataset.py", "--model-path", MODEL, "--num-samples", str(a.samples), "--max-seq-len", "1024",
             "--output-dir", prep], f"{w}/01.log", env)
        run(["03_build_vocab_mapping.py", "--prepared-data", prep, "--draft-vocab-size", "8192", "--output-dir", voc],
            f"{w}/03.log", env)
    cap = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         capture_output=True, text=True, env=env).stdout.strip()
    flags = compute.cpu_flags()
    model_name = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    res = {"cpu": model_name, "cores": os.cpu_count(), "torch_capability": cap, "avx2_env": a.avx2,
           "flags": sorted(f for f in flags if re.match(r"avx|amx|fma|f16c", f)),
           "auto": compute.resolve("auto", on_gpu=False).dtype}
    for dt in a.dtypes.split(","):
        r, tag = {}, f"{dt}{'-avx2' if a.avx2 else ''}"
        for backend in ("vllm", "hf"):
            hs = f"{w}/hs-{backend}-{tag}"
            r[f"02_{backend}_wall_s"] = round(run(
                ["02_extract_hidden_states.py", "--model-path", MODEL, "--prepared-data", prep, "--output-dir", hs,
                 "--max-seq-len", "1024", "--backend", backend, "--dtype", dt, "--overwrite"], f"{hs}.log", env), 1)
            r[f"02_{backend}_tok_s"] = json.load(open(f"{hs}/manifest.json"))["throughput"]["tokens_per_s"]
        ck = f"{w}/ck-{tag}"
        r["04_wall_s"] = round(run(
            ["04_train.py", "--model-path", MODEL, "--prepared-data", prep, "--hidden-states", f"{w}/hs-hf-{tag}",
             "--vocab-mapping", voc, "--output-dir", ck, "--total-seq-len", "2048", "--max-steps", str(a.steps),
             "--log-every", "1", "--dtype", dt, "--overwrite"], f"{ck}.log", env), 1)
        rates = [float(x.replace(",", "")) for x in re.findall(r"step (?:[4-9]|\d\d+)/\d+ .* ([0-9,]+) tok/s data",
                                                               open(f"{ck}.log").read())]
        r["04_tok_s"] = round(statistics.median(rates), 1) if rates else None
        ev = f"{w}/ev-{tag}"
        r["05_wall_s"] = round(run(
            ["05_evaluate.py", "--model-path", MODEL, "--draft", f"{ck}/last", "--prepared-data", prep,
             "--num-prompts", "4", "--max-new-tokens", "48", "--batch-sizes", "1", "--output-dir", ev, "--dtype", dt],
            f"{ev}.log", env), 1)
        rep = json.load(open(f"{ev}/report.json"))
        r["05_base_tok_s"] = rep["baseline"]["1"]["tokens_per_s"]
        r["05_spec_tok_s"] = rep["speculative"]["1"]["tokens_per_s"]
        res[tag] = r
        print(tag, json.dumps(r), flush=True)
    tags = [k for k in res if k.startswith(("bfloat16", "float32"))]
    if len(tags) == 2:
        b, f = res[tags[0]], res[tags[1]]
        res["float32_over_bf16"] = {k: round(f[k] / b[k], 2) for k in b if k.endswith("tok_s") and b[k] and f[k]}
    result(res)


if __name__ == "__main__":
    main()
