"""Benchmark: offline, online and cached training side by side on the embedded default (CPU), equal steps.

    python -m bench.bench_online_cpu --work /tmp/bo [--num-samples 60] [--epochs 2]

One stage 01 and one stage 03 run feed three stage 04 runs with the same seed and steps:
  offline  stage 02 (vLLM engine) writes every hidden state, then stage 04 reads them
  online   stage 04 --online: the vLLM engine generates each batch's states, which are deleted once read
  cached   stage 04 --online --cache-gb (room for all): generated in epoch 1, read from the cache afterwards
For each: wall time (offline: stage 02 + stage 04), peak disk of hidden states (polled every 0.2 s: stage 02's
folder; online, the engine's spool and the cache), the trainer's own acceptance estimate on the validation rows
(1 + the sum over draft positions of the probability that every token up to it is accepted; speculators'
full_acc) and the final validation loss. Prints one RESULT line (JSON); the ratios are against offline.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

from bench.common import REPO, result
MODEL = os.path.join(REPO, "data", "models", "smollm2-135m-instruct")


def tree_bytes(paths):
    total = 0
    for p in paths:
        for d, _, names in os.walk(p):
            for n in names:
                if n.endswith(".safetensors") and not n.startswith("model"):  # hidden states, not checkpoints
                    try:
                        total += os.path.getsize(os.path.join(d, n))
                    except OSError:
                        pass
    return total


def run(cmd, watch=()):
    """-> (seconds, peak bytes of *.safetensors under `watch` while it ran)."""
    peak, done = [0], threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], tree_bytes(watch))
            time.sleep(0.2)
    t = threading.Thread(target=poll, daemon=True)
    t.start()
    t0 = time.time()
    p = subprocess.run([sys.executable, *cmd], cwd=REPO, capture_output=True, text=True)
    secs = time.time() - t0
    done.set()
    t.join()
    if p.returncode:
        print(p.stderr[-4000:])
        raise SystemExit(f"{cmd[0]} failed ({p.returncode})")
    return secs, peak[0], p.stderr


def val_metrics(ckpt):
    vals = [json.loads(line) for line in open(os.path.join(ckpt, "logs", "metrics.jsonl")) if '"val"' in line]
    v = vals[-1]["val"]
    k = sorted(int(x.split("_")[2]) for x in v if x.startswith("full_acc_") and x.endswith("_epoch"))
    return {"val_acceptance_estimate": round(1 + sum(v[f"full_acc_{i}_epoch"] for i in k), 4),
            "val_loss": round(v["loss_epoch"], 4)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/bench_online")
    ap.add_argument("--num-samples", type=int, default=60)
    ap.add_argument("--epochs", type=int, default=2)
    a = ap.parse_args()
    w = a.work
    os.makedirs(w, exist_ok=True)
    prep, vocab = f"{w}/prepared", f"{w}/vocab"
    if not os.path.exists(f"{prep}/manifest.json"):
        run(["01_prepare_dataset.py", "--model-path", MODEL, "--num-samples", str(a.num_samples), "--max-seq-len",
             "1024", "--output-dir", prep])
        run(["03_build_vocab_mapping.py", "--prepared-data", prep, "--draft-vocab-size", "8192", "--output-dir", vocab])
    tokens = json.load(open(f"{prep}/manifest.json"))["counts"]["tokens"]
    common = ["04_train.py", "--model-path", MODEL, "--prepared-data", prep, "--vocab-mapping", vocab, "--epochs",
              str(a.epochs), "--total-seq-len", "1024", "--lr", "3e-3", "--log-every", "5", "--seed", "0"]
    res = {"rows": a.num_samples, "tokens": tokens, "epochs": a.epochs, "cpus": os.cpu_count()}

    if os.path.exists(f"{w}/offline.json"):  # a rerun of the online modes reuses the offline run
        res["offline"] = json.load(open(f"{w}/offline.json"))
    else:
        s02, peak02, _ = run(["02_extract_hidden_states.py", "--model-path", MODEL, "--prepared-data", prep,
                              "--output-dir", f"{w}/hs", "--max-seq-len", "1024"], [f"{w}/hs"])
        s04, _, _ = run(common + ["--hidden-states", f"{w}/hs", "--output-dir", f"{w}/ck_offline"])
        m = json.load(open(f"{w}/ck_offline/manifest.json"))
        res["offline"] = {"stage02_s": round(s02, 1), "stage04_s": round(s04, 1), "wall_s": round(s02 + s04, 1),
                          "peak_disk_bytes": peak02, "steps": m["steps"], "data_wait_fraction":
                          m.get("data_wait_fraction"), **val_metrics(f"{w}/ck_offline")}
        json.dump(res["offline"], open(f"{w}/offline.json", "w"))
    print(f"offline: {json.dumps(res['offline'])}", flush=True)
    full = res["offline"]["peak_disk_bytes"]
    for name, extra in (("online", []), ("cached", ["--cache-gb", f"{full * 1.2 / 1e9:.4f}"])):
        out = f"{w}/ck_{name}"
        if os.path.exists(out):
            import shutil
            shutil.rmtree(out)
        secs, peak, err = run(common + ["--online", "--output-dir", out, *extra], [out])
        m = json.load(open(f"{out}/manifest.json"))
        epochs = [line for line in err.splitlines() if "Training epoch" in line and "completed" in line]
        res[name] = {"wall_s": round(secs, 1), "peak_disk_bytes": peak, "steps": m["steps"],
                     "wall_ratio_vs_offline": round(secs / res["offline"]["wall_s"], 3),
                     "peak_disk_vs_offline": round(peak / full, 3), "online": m["online"],
                     "data_wait_fraction": m.get("data_wait_fraction"), "epoch_lines": epochs,
                     **val_metrics(out)}
        print(f"{name}: {json.dumps(res[name])}", flush=True)
    result(res)


if __name__ == "__main__":
    main()
