"""Benchmark: how long stage 04's first batch waits for its data-loader workers to start, speculators' way (each worker
spawned: a fresh interpreter importing torch, datasets and speculators) against warm_start.WorkerServer's (workers
forked from a server that imported them while the model loaded). Stage 02-format files at Kimi-K2.5's width (7168,
3 auxiliary states + the last), 1,024 tokens a sample, 8,192 a batch, read through stage 04's checked transfer and
speculators' own dataset and collate. Each measurement in a fresh process, the methods alternated:
  spawn       speculators' loader as it is: first batch after iter()
  warm        the server started, then `--overlap` seconds (the draft and verifier weights loading; 15-35 s on a
              lent H200), then the loader: first batch after iter()
  cold        the server started at iter() itself (nothing to overlap: the worst case)

    python -m bench.bench_worker_start [--workers 2] [--reps 2] [--overlap 20] [--storage bf16]

Prints one RESULT line (JSON): seconds to the first batch, each run, and the medians.
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

H, STATES, T, ROWS, SEQ = 7168, 4, 1024, 16, 8192


def build(folder, storage):
    """ROWS stage 02 files of T tokens and the Arrow table speculators reads."""
    import datasets
    import torch
    from eagle3pipe.formats import hidden_states as hs
    torch.manual_seed(0)
    rows = []
    for i in range(ROWS):
        ids = torch.randint(0, 32000, (T,))
        x = torch.randn(T, STATES, H, dtype=torch.bfloat16)
        t = {"hidden_states": x, "token_ids": ids}
        if storage == "fp8":
            t["hidden_states"], t[hs.SCALES] = hs.quantize_fp8(x)
        hs.save(hs.hs_path(folder, i), t)
        rows.append(ids.tolist())
    ds = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * T] * ROWS, "seq_len": [T] * ROWS})
    ds.set_format(type="torch")
    ds.save_to_disk(f"{folder}/table")


def child(a):
    """One measurement: the loader built as stage 04 builds it, seconds from iter() to the first batch."""
    t_start = time.perf_counter()
    from eagle3pipe import adapters
    from eagle3pipe.formats import fp8_transport
    from eagle3pipe.base import lifeline
    from eagle3pipe.train import warm_start
    lifeline.start()  # as stage 04 does: forked workers are the server's children, and end with this process
    from eagle3pipe.train.train_data import CheckedFiles
    import contextlib
    import torch
    ctx = contextlib.ExitStack()
    if a.child == "warm":
        server = warm_start.WorkerServer().start()
        ctx.enter_context(adapters.loader_workers(server.context, warm_start.worker_init))
        time.sleep(max(0.0, a.overlap - (time.perf_counter() - t_start)))  # the model's load, which it overlaps
    import speculators.train.dataloader as sdl
    from speculators.train.data import ArrowDataset
    packed = a.storage == "fp8"
    transfer = CheckedFiles(a.folder, STATES, H, f"{a.folder}/skipped.jsonl", rows=ROWS, packed=packed)
    cls = fp8_transport.dataset_class() if packed else ArrowDataset
    ds = cls(max_len=SEQ, datapath=f"{a.folder}/table", transfer=transfer, on_missing="skip",
             hidden_states_dtype=torch.bfloat16)
    t0 = time.perf_counter()
    if a.child == "cold":
        server = warm_start.WorkerServer().start()
        ctx.enter_context(adapters.loader_workers(server.context, warm_start.worker_init))
    with ctx:
        loader = sdl._setup_dataloader(ds, SEQ, H, num_workers=a.workers, num_target_layers=STATES - 1)
        batch = next(iter(loader))
        first = time.perf_counter() - t0
        assert int((batch["document_ids"] != -1).sum()) == SEQ
    print(json.dumps({"first_batch_s": round(first, 2)}))
    os._exit(0)  # persistent workers: no orderly shutdown to wait for


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--overlap", type=float, default=20.0)
    ap.add_argument("--storage", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--child", default=None)
    ap.add_argument("--folder", default=None)
    a = ap.parse_args()
    if a.child:
        return child(a)
    folder = tempfile.mkdtemp(prefix="worker_start_")
    build(folder, a.storage)
    runs = {m: [] for m in ("spawn", "warm", "cold")}
    for _ in range(a.reps):
        for m in runs:
            p = subprocess.run([sys.executable, "-m", "bench.bench_worker_start", "--child", m, "--folder", folder,
                                "--workers", str(a.workers), "--overlap", str(a.overlap), "--storage", a.storage],
                               cwd=REPO, capture_output=True, text=True, timeout=600)
            if p.returncode:
                raise SystemExit(p.stderr[-3000:])
            runs[m].append(json.loads(p.stdout.strip().splitlines()[-1])["first_batch_s"])
            print(m, runs[m][-1], flush=True)
    res = {"cpus": os.cpu_count(), "workers": a.workers, "overlap_s": a.overlap, "storage": a.storage, "runs": runs,
           "median_s": {m: statistics.median(v) for m, v in runs.items()}}
    res["spawn_over_warm"] = round(res["median_s"]["spawn"] / max(res["median_s"]["warm"], 1e-3), 1)
    result(res)


if __name__ == "__main__":
    main()
