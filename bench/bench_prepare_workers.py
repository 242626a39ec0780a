"""Benchmark: stage 01 in one process against --num-workers W, on the first N embedded ShareGPT conversations and
the embedded verifier's tokenizer, alternated (1, W, 1, W, ...) so that both meet the same machine; every run's
rows must be byte-identical. Timed: the whole stage (what the operator waits for) and the conversations phase alone
(stage 01's own tok/s line: reading the file and loading the tokenizer are the same in both).

    python -m bench.bench_prepare_workers [--samples 3000] [--workers 2] [--reps 2]

Prints one RESULT line (JSON): each run's seconds and tok/s, the medians and their ratio.
"""
import argparse
import hashlib
import os
import re
import statistics
import sys
import tempfile

from bench.common import REPO, result, run

MODEL = os.path.join(REPO, "data", "models", "smollm2-135m-instruct")


def once(work, samples, workers, rep):
    out = os.path.join(work, f"w{workers}-{rep}")
    p, secs = run([sys.executable, "01_prepare_dataset.py", "--model-path", MODEL, "--num-samples", str(samples),
                   "--num-workers", str(workers), "--output-dir", out], os.path.join(work, f"w{workers}-{rep}.log"))
    rate = [int(m.replace(",", "")) for m in re.findall(r"conversations \(100\.0%\) ([\d,]+) tok/s", p.stderr)]
    with open(os.path.join(out, "tokenized_data.jsonl"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return {"workers": workers, "seconds": round(secs, 2), "tok_s": rate[-1] if rate else None, "rows_sha": digest}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench01-") as work:
        for rep in range(a.reps):
            for w in (1, a.workers):
                runs.append(once(work, a.samples, w, rep))
                print(runs[-1], flush=True)
    if len({r["rows_sha"] for r in runs}) != 1:
        raise SystemExit(f"the rows differ between runs: {runs}")
    med = {w: {k: statistics.median(r[k] for r in runs if r["workers"] == w) for k in ("seconds", "tok_s")}
           for w in (1, a.workers)}
    result({"samples": a.samples, "workers": a.workers, "cpus": len(os.sched_getaffinity(0)), "runs": runs,
            "median": med, "stage_speedup": round(med[1]["seconds"] / med[a.workers]["seconds"], 2),
            "conversations_speedup": round(med[a.workers]["tok_s"] / med[1]["tok_s"], 2)})


if __name__ == "__main__":
    main()
