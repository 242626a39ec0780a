"""Benchmark: how long a vLLM engine on a CPU takes to start, with the 2 GiB KV cache every CPU engine had
(VLLM_CPU_KVCACHE_SPACE=2) against the cache engine.make_llm sizes now (engine.cpu_kv_cache_bytes: twice an upper
bound of what the engine holds at once). vLLM-CPU fills its whole cache before the engine answers. The engine is
stage 05's at batch 1: the embedded verifier, float32, eager, 157 positions, max_num_seqs 1, no draft. Each start in
a fresh process, the two settings alternated, through engine.make_llm itself; then four prompts of 24 greedy
tokens, which must agree between the two.

    python -m bench.bench_engine_start [--reps 2]

Prints one RESULT line (JSON): seconds from LLM() to a ready engine and vLLM's own "init engine" figure, each run,
and the medians.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import REPO, result

MODEL = os.path.join(REPO, "data", "models", "smollm2-135m-instruct")


def child(setting, log_path):
    """One engine start, as stage 05 starts its baseline engine. -> prints a JSON line."""
    if setting == "fixed":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "2"
    else:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from eagle3pipe.engines import engine
    t0 = time.perf_counter()
    llm = engine.make_llm(MODEL, tp=1, max_model_len=157, on_gpu=False, trust_remote_code=False, dtype="float32",
                          log_path=log_path, enable_prefix_caching=False, max_num_seqs=1)
    ready = time.perf_counter() - t0
    from vllm import SamplingParams
    outs = engine.generate(llm, [f"Question {i}: what is {i} + {i}?" for i in range(4)],
                           SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    print(json.dumps({"ready_s": ready, "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
    os._exit(0)  # the engine's processes end with this one (lifeline); its shutdown is not what is measured


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--child", choices=("fixed", "sized"))
    p.add_argument("--log")
    a = p.parse_args()
    if a.child:
        return child(a.child, a.log)
    runs = {"fixed": [], "sized": []}
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for setting in ("fixed", "sized") if rep % 2 == 0 else ("sized", "fixed"):
                log = os.path.join(tmp, f"{setting}{rep}.log")
                proc = subprocess.run([sys.executable, "-m", "bench.bench_engine_start", "--child", setting, "--log",
                                       log], cwd=REPO, capture_output=True, text=True, timeout=600)
                if proc.returncode:
                    sys.exit(f"{setting}: exit {proc.returncode}: {proc.stderr[-2000:]}")
                rec = json.loads(proc.stdout.strip().splitlines()[-1])
                text = open(log).read()
                init = re.findall(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s", text)
                cache = re.findall(r"CPU KV cache size: ([0-9,]+) tokens", text)
                runs[setting].append({"ready_s": round(rec["ready_s"], 1), "vllm_init_s": float(init[-1]),
                                      "kv_cache_tokens": int(cache[-1].replace(",", ""))})
                outputs.setdefault(setting, rec["tokens"])
                print(setting, runs[setting][-1], flush=True)
    result({"runs": runs, "same_outputs": outputs["fixed"] == outputs["sized"],
            "median_ready_s": {k: statistics.median(r["ready_s"] for r in v) for k, v in runs.items()},
            "median_vllm_init_s": {k: statistics.median(r["vllm_init_s"] for r in v) for k, v in runs.items()}})


if __name__ == "__main__":
    main()
