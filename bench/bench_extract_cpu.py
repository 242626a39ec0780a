"""Benchmark: stage 02 (vLLM backend, CPU) against the same vLLM engine's bare prefill on the same samples, and
against speculators' `generate-offline-data` (through a vLLM server) on the same conversations.

    .venv/bin/python -m bench.bench_extract_cpu --num-samples 300 [--batch-size 4] [--repeats 2] [--no-speculators]

One script, one machine: stage 01 on the first N ShareGPT conversations; then, `--repeats` times, stage 02 end to end
(its own process; its manifest's seconds run from the first batch to the last file written, load excluded) and a
plain vllm.LLM (no speculative config, no connector: `max_tokens=1`) over the same rows in the same longest-first
batches of the same size, each in its own process, alternating so that drift on a shared machine hits both.
Finally bench/speculators_pipeline.sh with STOP_AFTER_EXTRACT on the same N conversations: speculators' prepare-data
(one row per assistant turn) and generate-offline-data at the same concurrency; its extraction seconds exclude the
server's start. Prints one RESULT line (JSON): tokens/s of each and the ratios.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import REPO, result
MODEL = os.path.join(REPO, "data", "models", "smollm2-135m-instruct")


def bare_prefill(prep, batch_size, max_seq_len):
    """In a fresh process (vLLM's engine does not shut down cleanly in-process): tokens/s of a bare prefill."""
    from eagle3pipe.engines.engine import cpu_vllm_env
    from eagle3pipe.extract.extraction import make_batches
    cpu_vllm_env()
    from vllm import LLM, SamplingParams
    rows = [json.loads(l)["input_ids"] for l in open(os.path.join(prep, "tokenized_data.jsonl"))]
    llm = LLM(model=MODEL, dtype="bfloat16", max_model_len=max_seq_len + 1, max_num_seqs=batch_size,
              max_num_batched_tokens=batch_size * max_seq_len, enable_prefix_caching=False, enforce_eager=True)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.time()
    for b in make_batches(range(len(rows)), [len(r) for r in rows], batch_size):
        llm.generate([{"prompt_token_ids": rows[i]} for i in b], params, use_tqdm=False)
    print("BARE", sum(map(len, rows)) / (time.time() - t0), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-samples", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-speculators", action="store_true")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--bare-only", metavar="PREP", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.bare_only:
        return bare_prefill(a.bare_only, a.batch_size, a.max_seq_len)
    work = a.work_dir or tempfile.mkdtemp(prefix="bench02-")
    prep, hs, py = os.path.join(work, "prepared"), os.path.join(work, "hs"), sys.executable
    subprocess.run([py, "01_prepare_dataset.py", "--model-path", MODEL, "--num-samples", str(a.num_samples),
                    "--max-seq-len", str(a.max_seq_len), "--output-dir", prep], cwd=REPO, check=True)
    ours, bare = [], []
    for r in range(a.repeats):
        subprocess.run([py, "02_extract_hidden_states.py", "--model-path", MODEL, "--prepared-data", prep,
                        "--output-dir", hs, "--overwrite", "--batch-size", str(a.batch_size),
                        "--max-seq-len", str(a.max_seq_len)], cwd=REPO, check=True)
        man = json.load(open(os.path.join(hs, "manifest.json")))
        ours.append(man["throughput"]["tokens_per_s"])
        p = subprocess.run([py, __file__, "--bare-only", prep, "--batch-size", str(a.batch_size),
                            "--max-seq-len", str(a.max_seq_len)], cwd=REPO, check=True, capture_output=True, text=True)
        bare.append(float(next(l for l in p.stdout.splitlines() if l.startswith("BARE")).split()[1]))
        print(f"round {r + 1}: stage 02 {ours[-1]:,.0f} tok/s, bare prefill {bare[-1]:,.0f} tok/s", flush=True)
    res = {"samples": man["counts"]["rows"], "tokens": man["counts"]["tokens_extracted"], "batch_size": a.batch_size,
           "stage02_tok_s": ours, "bare_prefill_tok_s": [round(b, 1) for b in bare],
           "ratio_vs_bare": round(statistics.mean(ours) / statistics.mean(bare), 3),
           "stage02_gb": round(man["counts"]["bytes"] / 1e9, 2)}
    if not a.no_speculators:
        from eagle3pipe.chat.conversations import iter_records
        convs = [rec for (_, rec), _ in zip(iter_records("sharegpt"), range(a.num_samples))]
        data = os.path.join(work, "conversations.json")
        json.dump(convs, open(data, "w"))
        spec = os.path.join(work, "speculators")
        subprocess.run(["bash", "bench/speculators_pipeline.sh", data, spec, str(a.max_seq_len)], cwd=REPO, check=True,
                       env=dict(os.environ, STOP_AFTER_EXTRACT="1", CONCURRENCY=str(a.batch_size)))
        times = dict(l.split("\t") for l in open(os.path.join(spec, "times.txt")) if not l.startswith("#"))
        stats = dict(l.split("\t") for l in open(os.path.join(spec, "stats.txt")))
        secs = float(times["generate_offline_data"])
        res["speculators"] = {"rows": int(stats["rows"]), "tokens": int(stats["tokens"]), "seconds": secs,
                              "tok_s": round(int(stats["tokens"]) / secs, 1), "hs_files": int(stats["hs_files"])}
        res["ratio_vs_speculators_tok_s"] = round(statistics.mean(ours) / res["speculators"]["tok_s"], 3)
        ours_secs = man["counts"]["tokens_extracted"] / statistics.mean(ours)
        res["ratio_vs_speculators_wall_same_conversations"] = round(secs / ours_secs, 3)
    result(res)


if __name__ == "__main__":
    main()
