"""Benchmark: how stage 02's time, memory and disk grow with the number of samples and the sequence length (CPU,
vLLM backend, the embedded SmolLM2 and ShareGPT).

    .venv/bin/python -m bench.bench_scaling [--points 100x2048,300x2048,1000x2048,300x512,300x1024] [--plot docs/scaling.png]
    .venv/bin/python -m bench.bench_scaling --replot LOG     # redraw the plot from a run's printed output

For each point NxL: stage 01 on the first N conversations truncated to L tokens, then stage 02 in its own process,
while this script samples the resident memory of stage 02's whole process tree (the engine runs in child processes)
every 0.5 s. Records extraction seconds (load excluded), wall seconds (load included), peak RSS and bytes written.
Prints a markdown table and one RESULT line (JSON); writes a two-panel plot.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

from bench.common import REPO, result
MODEL = os.path.join(REPO, "data", "models", "smollm2-135m-instruct")


def tree_rss(p):
    try:
        procs = [p] + p.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total


def point(work, n, seq, batch_size):
    py, prep, hs = sys.executable, f"{work}/prep_{n}x{seq}", f"{work}/hs_{n}x{seq}"
    subprocess.run([py, "01_prepare_dataset.py", "--model-path", MODEL, "--num-samples", str(n), "--max-seq-len",
                    str(seq), "--output-dir", prep], cwd=REPO, check=True, capture_output=True)
    t0, peak = time.time(), 0
    proc = subprocess.Popen([py, "02_extract_hidden_states.py", "--model-path", MODEL, "--prepared-data", prep,
                             "--output-dir", hs, "--overwrite", "--batch-size", str(batch_size), "--max-seq-len", str(seq)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ps = psutil.Process(proc.pid)
    while proc.poll() is None:
        peak = max(peak, tree_rss(ps))
        time.sleep(0.5)
    if proc.returncode:
        raise SystemExit(f"stage 02 failed at {n}x{seq}")
    m = json.load(open(f"{hs}/manifest.json"))
    return {"requested": n, "samples": m["counts"]["rows"], "max_seq_len": seq, "tokens": m["counts"]["tokens_extracted"],
            "extract_s": m["throughput"]["seconds"], "tok_s": m["throughput"]["tokens_per_s"],
            "wall_s": round(time.time() - t0, 1), "peak_rss_gib": round(peak / 2**30, 2),
            "disk_gb": round(m["counts"]["bytes"] / 1e9, 3)}


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    # left: the points of 300 requested conversations (fewer rows survive truncation); right: those at 2,048 tokens
    for ax, (key, label) in zip(axes, (("max_seq_len", "max tokens per sample"), ("samples", "samples (rows)"))):
        fixed = [r for r in rows if (r["requested"] == 300 if key == "max_seq_len" else r["max_seq_len"] == 2048)]
        fixed.sort(key=lambda r: r[key])
        x = [r[key] for r in fixed]
        ax.plot(x, [r["extract_s"] for r in fixed], "o-", label="extract s")
        ax.plot(x, [r["disk_gb"] * 100 for r in fixed], "s-", label="disk GB x100")
        ax.plot(x, [r["peak_rss_gib"] * 100 for r in fixed], "^-", label="peak RSS GiB x100")
        ax.set(xlabel=label, title=f"stage 02 on CPU vs {label}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="100x2048,300x2048,1000x2048,300x512,300x1024")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--plot", default=os.path.join(REPO, "docs", "scaling.png"))
    ap.add_argument("--replot", metavar="LOG", help="only redraw the plot from an earlier run's output")
    a = ap.parse_args()
    if a.replot:
        rows = json.loads(next(l for l in open(a.replot) if l.startswith("RESULT "))[7:])
        for r, p in zip(rows, a.points.split(",")):  # runs before "requested" was recorded: the points' order
            r.setdefault("requested", int(p.split("x")[0]))
        return plot(rows, a.plot)
    work = a.work_dir or tempfile.mkdtemp(prefix="scaling-")
    rows = []
    for p in a.points.split(","):
        n, seq = map(int, p.split("x"))
        rows.append(point(work, n, seq, a.batch_size))
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(f"{work}/hs_{n}x{seq}", ignore_errors=True)
    print("| samples | max tokens | tokens | extract s | tok/s | wall s (with load) | peak RSS GiB | disk GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['samples']} | {r['max_seq_len']} | {r['tokens']:,} | {r['extract_s']:.0f} | {r['tok_s']:,.0f} | "
              f"{r['wall_s']:.0f} | {r['peak_rss_gib']} | {r['disk_gb']} |")
    plot(rows, a.plot)
    result(rows)


if __name__ == "__main__":
    main()
