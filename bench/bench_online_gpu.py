"""Benchmark: online against offline training on two NVIDIA GPUs, an 8B-shaped verifier (Llama-3-8B's widths:
hidden 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336; random weights, SmolLM2's vocabulary).

    python -m bench.bench_online_gpu --assets .gpu --work /tmp/o [--num-samples 500] [--max-steps 60]

offline  stage 02 (HF backend, GPU 0) writes every state; stage 04 trains on GPU 1
online   stage 04 --online --backend hf --engine-gpus 0: the engine on GPU 0 generates each batch's states while
         training runs on GPU 1 (vLLM is not on the lent image; the HF engine is the slower of the two)
On a single GPU both share it: offline trains on it alone, online runs the engine beside the trainer.
cached   (--cached) stage 04 --online --cache-gb with room for all, two epochs: the second reads the cache
Stage 04's speed is speculators' own per-step profile (tokens / step time, the wait for the batch included), averaged
over the logged steps after the first 10; `data wait` is the share of the step spent waiting for the batch.
--assets: SmolLM2's tokenizer files and config.json, and train.json (ShareGPT). Prints one RESULT line (JSON).
"""
import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import REPO, result, save_random

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)


def run(cmd, log, gpus):
    t0 = time.time()
    p = subprocess.run([sys.executable, *cmd], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpus, PYTHONUNBUFFERED="1"))
    open(log, "w").write(p.stdout + p.stderr)
    if p.returncode:
        print((p.stdout + p.stderr)[-5000:], flush=True)
        raise SystemExit(f"{cmd[0]} failed ({p.returncode})")
    return time.time() - t0, p.stderr


def train_speed(ckpt, skip=10, epoch=None, first_epoch_only=False):
    """Mean tok/s and data wait over the logged steps from `skip` on (or those of epochs >= `epoch`, or of the
    first epoch alone)."""
    recs = [json.loads(line) for line in open(os.path.join(ckpt, "logs", "metrics.jsonl")) if '"train"' in line]
    prof = [r["profile"] for r in recs if r.get("profile") and r["global_step"] >= skip
            and (epoch is None or r["epoch"] >= epoch) and not (first_epoch_only and r["epoch"] > 0)]
    return {"tok_s": round(sum(p["tokens_per_s"] for p in prof) / len(prof), 1),
            "data_wait": round(sum(p["fetch_ms"] for p in prof) / sum(p["step_ms"] for p in prof), 4),
            "logged_steps": len(prof)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--assets", required=True)
    ap.add_argument("--work", default="/tmp/o")
    ap.add_argument("--out", default=".")
    ap.add_argument("--num-samples", type=int, default=500)
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--cached", action="store_true")
    ap.add_argument("--skip-online", action="store_true")
    a = ap.parse_args()
    import torch
    w, res = a.work, {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__}
    os.makedirs(w, exist_ok=True)
    model, prep, vocab = f"{w}/v8b", f"{w}/prep", f"{w}/vocab"
    t0 = time.time()
    if not os.path.exists(f"{model}/config.json"):
        from transformers import LlamaConfig
        cfg = LlamaConfig(vocab_size=json.load(open(f"{a.assets}/config.json"))["vocab_size"], **LLAMA_8B)
        save_random(cfg, a.assets, model)
        os.sync()
    res["verifier_create_s"] = round(time.time() - t0, 1)
    run(["01_prepare_dataset.py", "--model-path", model, "--dataset", f"{a.assets}/train.json", "--num-samples",
         str(a.num_samples), "--max-seq-len", "2048", "--output-dir", prep], f"{a.out}/o_01.log", "0")
    run(["03_build_vocab_mapping.py", "--prepared-data", prep, "--draft-vocab-size", "32000", "--output-dir", vocab],
        f"{a.out}/o_03.log", "0")
    res["tokens"] = json.load(open(f"{prep}/manifest.json"))["counts"]["tokens"]
    common = ["04_train.py", "--model-path", model, "--prepared-data", prep, "--vocab-mapping", vocab, "--epochs", "5",
              "--max-steps", str(a.max_steps), "--log-every", "2"]

    s02, _ = run(["02_extract_hidden_states.py", "--backend", "hf", "--model-path", model, "--prepared-data", prep,
                  "--output-dir", f"{w}/hs", "--batch-size", "8"], f"{a.out}/o_02.log", "0")
    m = json.load(open(f"{w}/hs/manifest.json"))
    res["stage02"] = {"wall_s": round(s02, 1), "tok_s": m["throughput"]["tokens_per_s"],
                      "disk_gb": round(m["counts"]["bytes"] / 1e9, 2)}
    # two GPUs: the engine on GPU 0, training on GPU 1; one GPU: both share it (offline trains on it alone)
    train_gpu, both = ("1", "0,1") if res["gpus"] >= 2 else ("0", "0")
    res["layout"] = "engine GPU 0, training GPU 1" if res["gpus"] >= 2 else "engine and training share GPU 0"
    s04, _ = run(common + ["--hidden-states", f"{w}/hs", "--output-dir", f"{w}/ck_off"], f"{a.out}/o_04_off.log",
                 train_gpu)
    res["offline"] = {"wall_s": round(s04, 1), **train_speed(f"{w}/ck_off")}
    print(f"offline: {json.dumps(res['offline'])}", flush=True)

    if not a.skip_online:
        s04, err = run(common + ["--online", "--backend", "hf", "--engine-gpus", "0", "--output-dir", f"{w}/ck_on"],
                       f"{a.out}/o_04_on.log", both)
        res["online"] = {"wall_s": round(s04, 1), **train_speed(f"{w}/ck_on"),
                         "engine_line": next((x for x in err.splitlines() if "ready in" in x), "")[20:]}
        res["online_vs_offline_tok_s"] = round(res["online"]["tok_s"] / res["offline"]["tok_s"], 3)
        print(f"online: {json.dumps(res['online'])}", flush=True)
    if a.cached:
        s04, err = run(common + ["--online", "--backend", "hf", "--engine-gpus", "0", "--cache-gb", "100",
                                 "--output-dir", f"{w}/ck_cached"], f"{a.out}/o_04_cached.log", both)
        res["cached"] = {"wall_s": round(s04, 1), "epoch_1": train_speed(f"{w}/ck_cached", first_epoch_only=True),
                         "later_epochs": train_speed(f"{w}/ck_cached", skip=0, epoch=1),
                         "online": json.load(open(f"{w}/ck_cached/manifest.json"))["online"]}
        res["cached_later_epochs_vs_offline_tok_s"] = round(res["cached"]["later_epochs"]["tok_s"] /
                                                            res["offline"]["tok_s"], 3)
    result(res)


if __name__ == "__main__":
    main()
