"""Benchmark: stage 04 against speculators' own `train` command on the same data, flags and hardware (CPU or GPU),
and optionally stage 04 under torchrun on N GPUs.

    python -m bench.bench_train --model-path M --prepared-data P --hidden-states H --vocab-mapping V \
        --work /tmp/bt [--steps 40] [--total-seq-len 8192] [--ddp 2] [-- more flags for both]

Stage 04 runs first (it builds the Arrow bridge of ids and masks in <work>/ours/.bridge); speculators' command then
reads that same table with the same hs_{i}.safetensors and d2t/t2d (bench/speculators_train.py: speculators'
TrainConfig.resolve + speculators.train.cli.main, plus only the CPU patches when there is no accelerator). Both
get the same number of dataloader workers unless --their-workers says otherwise (12 is speculators' default).
Throughput is the median of speculators' per-step `tokens_per_s` after the first 5 steps (per rank), and
tokens per wall second over the whole command. Prints one RESULT line (JSON).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from bench.common import REPO, result


def timed(cmd, log, env=None):
    # each command compiles into its own cold cache: with a shared one the second command skips the first's
    # compilation (2 min on an H200) and the wall-time ratio measures the cache, not the trainers
    name = os.path.splitext(os.path.basename(log))[0]
    caches = {k: os.path.join(os.path.dirname(log), f".{k.split('_')[0].lower()}-{name}")
              for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    for d in caches.values():
        shutil.rmtree(d, ignore_errors=True)
    env = dict(env or os.environ, **caches)
    t = time.time()
    with open(log, "w") as f:
        p = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    if p.returncode:
        print(open(log).read()[-3000:])
        raise SystemExit(f"{cmd[:3]} failed ({p.returncode}); log {log}")
    return time.time() - t


def rates(save_path):
    recs = [json.loads(l) for l in open(os.path.join(save_path, "logs", "metrics.jsonl")) if '"train"' in l]
    tps = [r["profile"]["tokens_per_s"] for r in recs if r.get("profile")][5:]
    fetch = [r["profile"].get("fetch_frac", 0) for r in recs if r.get("profile")][5:]
    return {"steps": len(recs), "median_tok_s": round(statistics.median(tps), 1) if tps else None,
            "median_fetch_frac": round(statistics.median(fetch), 3) if fetch else None,
            "last_loss": round(recs[-1]["train"]["loss"], 3) if recs else None}


def main():
    ap = argparse.ArgumentParser()
    for f in ("model-path", "prepared-data", "hidden-states", "vocab-mapping"):
        ap.add_argument(f"--{f}", required=True)
    ap.add_argument("--work", default="/tmp/bt")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--total-seq-len", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=None, help="dataloader workers for both (default: stage 04's)")
    ap.add_argument("--their-workers", type=int, default=None, help="speculators' workers, if different")
    ap.add_argument("--ddp", type=int, default=0, help="also run stage 04 under torchrun on this many GPUs")
    ap.add_argument("extra", nargs="*", help="flags for both commands, e.g. --loss-implementation eager")
    a = ap.parse_args()
    py, w = sys.executable, a.work
    os.makedirs(w, exist_ok=True)
    ours = [py, "04_train.py", "--model-path", a.model_path, "--prepared-data", a.prepared_data,
            "--hidden-states", a.hidden_states, "--vocab-mapping", a.vocab_mapping, "--max-steps", str(a.steps),
            "--total-seq-len", str(a.total_seq_len), "--log-every", "1", "--epochs", "100", "--overwrite", *a.extra]
    if a.workers is not None:
        ours += ["--num-workers", str(a.workers)]
    res = {"steps": a.steps, "total_seq_len": a.total_seq_len}
    res["ours_wall_s"] = round(timed(ours + ["--output-dir", f"{w}/ours"], f"{w}/ours.log"), 1)
    res["ours"] = rates(f"{w}/ours")
    run_cfg = json.load(open(f"{w}/ours/manifest.json"))["speculators_config"]
    workers = a.their_workers if a.their_workers is not None else run_cfg["num_workers"]
    ext = json.load(open(os.path.join(a.hidden_states, "manifest.json")))
    theirs = [py, "-m", "bench.speculators_train", "--speculator-type", "eagle3", "--verifier-name-or-path", a.model_path,
              "--target-layer-ids", *map(str, ext["layer_ids"][:-1]), "--num-layers", "1",
              "--data-path", f"{w}/ours/.bridge", "--hidden-states-path", os.path.abspath(a.hidden_states),
              "--hidden-states-backend", "fp8" if ext.get("storage_dtype") == "fp8" else "file",
              "--d2t-path", f"{a.vocab_mapping}/d2t.npy", "--t2d-path", f"{a.vocab_mapping}/t2d.npy",
              "--total-seq-len", str(a.total_seq_len), "--max-steps", str(a.steps), "--epochs", "100",
              "--num-workers", str(workers), "--on-missing", "skip", "--lr", str(run_cfg["lr"]),
              "--train-data-ratio", str(run_cfg["train_data_ratio"]),
              "--draft-attn-impl", run_cfg["draft_attn_impl"], "--loss-implementation", run_cfg["loss_implementation"],
              "--save-path", f"{w}/theirs", "--log-dir", f"{w}/theirs/logs"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res["theirs_workers"] = workers
    res["theirs_wall_s"] = round(timed(theirs, f"{w}/theirs.log", env), 1)
    res["theirs"] = rates(f"{w}/theirs")
    res["ratio_step_tok_s"] = round(res["ours"]["median_tok_s"] / res["theirs"]["median_tok_s"], 3)
    res["ratio_wall"] = round(res["theirs_wall_s"] / res["ours_wall_s"], 3)
    if a.ddp:
        cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.ddp), *ours[1:]]
        res["ddp_wall_s"] = round(timed(cmd + ["--output-dir", f"{w}/ddp"], f"{w}/ddp.log"), 1)
        res["ddp"] = rates(f"{w}/ddp")  # per rank; each global step moves ddp x the tokens
        res["ddp_speedup_tok_s"] = round(a.ddp * res["ddp"]["median_tok_s"] / res["ours"]["median_tok_s"], 2)
    result(res)


if __name__ == "__main__":
    main()
