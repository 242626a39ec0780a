"""Benchmark: stage 02 (vLLM backend, CPU) against the same vLLM engine's bare prefill on the same samples.

    .venv/bin/python bench/bench_extract_cpu.py --num-samples 300 [--batch-size 4]

Runs, in one script on one machine: stage 01 on the first N ShareGPT conversations; stage 02 end to end
(its own subprocess; the manifest's extraction seconds exclude the model load); then, in this process, a
plain vllm.LLM (no speculative config, no connector) generating one token per prompt on the same rows with the
same batch size. Prints tokens/s of both and their ratio. Both exclude model load.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(REPO, "data", "models", "smollm2-135m-instruct")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-samples", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--work-dir", default=None)
    a = ap.parse_args()
    work = a.work_dir or tempfile.mkdtemp(prefix="bench02-")
    prep, hs = os.path.join(work, "prepared"), os.path.join(work, "hs")
    py = sys.executable
    subprocess.run([py, "01_prepare_dataset.py", "--model-path", MODEL, "--num-samples", str(a.num_samples),
                    "--max-seq-len", str(a.max_seq_len), "--output-dir", prep], cwd=REPO, check=True)
    t0 = time.time()
    subprocess.run([py, "02_extract_hidden_states.py", "--model-path", MODEL, "--prepared-data", prep,
                    "--output-dir", hs, "--overwrite", "--batch-size", str(a.batch_size),
                    "--max-seq-len", str(a.max_seq_len)], cwd=REPO, check=True)
    wall02 = time.time() - t0
    man = json.load(open(os.path.join(hs, "manifest.json")))
    ours_tps = man["throughput"]["tokens_per_s"]

    sys.path.insert(0, REPO)
    from eagle3pipe.backends import cpu_vllm_env
    from eagle3pipe.extraction import make_batches
    cpu_vllm_env()
    from vllm import LLM, SamplingParams
    rows = [json.loads(l)["input_ids"] for l in open(os.path.join(prep, "tokenized_data.jsonl"))]
    llm = LLM(model=MODEL, dtype="bfloat16", max_model_len=a.max_seq_len + 1, max_num_seqs=a.batch_size,
              max_num_batched_tokens=a.batch_size * a.max_seq_len, enable_prefix_caching=False, enforce_eager=True)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    batches = make_batches(range(len(rows)), [len(r) for r in rows], a.batch_size)
    t0 = time.time()
    for b in batches:
        llm.generate([{"prompt_token_ids": rows[i]} for i in b], params, use_tqdm=False)
    secs = time.time() - t0
    tokens = sum(len(r) for r in rows)
    bare_tps = tokens / secs
    result = {"samples": len(rows), "tokens": tokens, "batch_size": a.batch_size,
              "stage02_tokens_per_s": ours_tps, "stage02_wall_s_incl_load": round(wall02, 1),
              "bare_prefill_tokens_per_s": round(bare_tps, 1), "ratio": round(ours_tps / bare_tps, 3),
              "stage02_gb": round(man["counts"]["bytes"] / 1e9, 2)}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
