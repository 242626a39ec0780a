"""Benchmark: Kimi-K2.5's architecture class on one NVIDIA GPU. A random DeepSeek-V3 at Kimi's width (hidden 7168, MLA
latent 512, 64 heads, routed experts of 2048 plus a shared one, `noaux_tc` routing) in two depths, through stage 02
(HF backend: vLLM is not on the lent image) against a bare forward of the same batches, bf16 and fp8 storage, then
stages 03 and 04 with default settings on the shallow one (stage 04's loss chosen by its probe), timing how long
stage 04 takes to exit after its last line.

    python -m bench.bench_kimi_gpu --assets .gpu --work /tmp/k [--num-samples 250] [--depths 4,12] [--hs-dir /dev/shm]
                                   [--variants bf16,bf16_4_writers,fp8] [--no-cold] [--train-steps 40]

--assets: the tokenizer files and config.json of SmolLM2 (the vocabulary; the weights are random: this measures
speed, not quality) and train.json (ShareGPT). Prints one RESULT line (JSON).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from bench.common import REPO, bare_forward, deepseek_v3, result, run, stage02, wait


def cold_bare(model, prep, batch_size):
    """(tok/s, steady tok/s) of the bare forward's only pass in a new process (the first batch warmed, as in
    bare_forward), the way stage 02 meets its batches."""
    code = f"""
import json, sys
from bench.common import bare_forward
from bench.bench_kimi_gpu import bare_steady
from eagle3pipe.extract.extraction import make_batches
rows = [json.loads(l)["input_ids"] for l in open({prep!r} + "/tokenized_data.jsonl")]
per_batch = []
secs = bare_forward({model!r}, rows, make_batches(range(len(rows)), [len(x) for x in rows], {batch_size}), per_batch)
print("COLD", json.dumps([round(sum(map(len, rows)) / secs, 1), round(bare_steady(per_batch), 1)]))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    line = [x for x in p.stdout.splitlines() if x.startswith("COLD ")]
    if not line:
        raise SystemExit(f"cold bare pass failed: {(p.stdout + p.stderr)[-2000:]}")
    return json.loads(line[0][5:])


def steady_rate(out, rows, lo=0.1, hi=0.9):
    """Tokens/s of stage 02 in its steady state: the files written between the 10th and 90th percentile of their
    write times (a short run's first batch and its writers' final drain are fixed costs a 20-hour run does not see)."""
    t = sorted((os.path.getmtime(f"{out}/hs_{i}.safetensors"), len(r)) for i, r in enumerate(rows)
               if os.path.exists(f"{out}/hs_{i}.safetensors"))
    a, b = int(len(t) * lo), int(len(t) * hi)
    return sum(n for _, n in t[a + 1:b + 1]) / (t[b][0] - t[a][0])


def bare_steady(per_batch, lo=0.1, hi=0.9):
    a, b = int(len(per_batch) * lo), int(len(per_batch) * hi)
    mid = per_batch[a:b]
    return sum(n for _, n in mid) / sum(s for s, _ in mid)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--assets", required=True)
    ap.add_argument("--work", default="/tmp/k")
    ap.add_argument("--out", default=".")
    ap.add_argument("--num-samples", type=int, default=250)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--depths", default="4,12")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=40)
    ap.add_argument("--hs-dir", default=None, help="where stage 02 writes (default --work); /dev/shm takes the disk "
                    "out of the measurement: what the code reaches when the storage keeps up")
    ap.add_argument("--variants", default="bf16,bf16_4_writers,fp8", help="stage 02 runs: bf16 (defaults), "
                    "bf16_4_writers, fp8")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold bare pass in a fresh process")
    a = ap.parse_args()
    import torch
    from eagle3pipe.extract.extraction import make_batches
    py, w, res = sys.executable, a.work, {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    os.makedirs(w, exist_ok=True)
    bs = ["--batch-size", str(a.batch_size)]
    for n in [int(x) for x in a.depths.split(",")]:
        model, prep, r = f"{w}/v{n}", f"{w}/prep{n}", {}
        t0 = time.time()
        deepseek_v3(a.assets, model, n, a.experts, a.topk)
        r["verifier_create_s"] = round(time.time() - t0, 1)
        run([py, "01_prepare_dataset.py", "--model-path", model, "--dataset", f"{a.assets}/train.json", "--num-samples",
             str(a.num_samples), "--max-seq-len", "2048", "--output-dir", prep], f"{a.out}/k{n}_01.log")
        rows = [json.loads(l)["input_ids"] for l in open(f"{prep}/tokenized_data.jsonl")]
        r["tokens"] = tokens = sum(map(len, rows))
        ids = ["--layer-ids", "1,2,3"] if n < 7 else []  # the default [2, n//2, n-3] collides below 7 layers
        per_batch, batches = [], make_batches(range(len(rows)), [len(x) for x in rows], a.batch_size)
        # a fresh process's single pass, as stage 02 runs: every batch shape met for the first time
        if not a.no_cold:
            r["bare_cold_tok_s"], r["bare_cold_steady_tok_s"] = cold_bare(model, prep, a.batch_size)
        # the reference: a first full pass untimed (every batch shape's per-shape setup done: cuDNN's attention
        # plans, 0.30-0.37x of warm when cold), then the timed one
        bare_forward(model, rows, batches)
        bare = tokens / bare_forward(model, rows, batches, per_batch)
        r["bare_forward_tok_s"], r["bare_steady_tok_s"] = round(bare, 1), round(bare_steady(per_batch), 1)
        variants = {"bf16": [], "bf16_4_writers": ["--writer-threads", "4"], "fp8": ["--storage-dtype", "fp8"]}
        for name, extra in ((v, variants[v]) for v in a.variants.split(",")):
            out = f"{a.hs_dir or w}/hs{n}_{name}"
            wait(stage02(model, prep, out, *bs, *ids, *extra), f"stage 02 {name}")
            m = json.load(open(f"{out}/manifest.json"))
            r[f"stage02_{name}_tok_s"] = m["throughput"]["tokens_per_s"]
            r[f"ratio_{name}"] = round(m["throughput"]["tokens_per_s"] / bare, 3)
            r[f"steady_ratio_{name}"] = round(steady_rate(out, rows) / r["bare_steady_tok_s"], 3)
            r[f"disk_gb_{name}"] = round(m["counts"]["bytes"] / 1e9, 2)
            if name != "bf16" or n != min(int(x) for x in a.depths.split(",")) or not a.train_steps:
                shutil.rmtree(out)
            os.sync()
        res[f"depth_{n}"] = r
        print(f"depth {n}: {json.dumps(r)}", flush=True)
        if n == min(int(x) for x in a.depths.split(",")) and a.train_steps:
            res["train_defaults"] = train(a, py, w, model, prep, f"{a.hs_dir or w}/hs{n}_bf16")
            print(f"train: {json.dumps(res['train_defaults'])}", flush=True)
            shutil.rmtree(f"{a.hs_dir or w}/hs{n}_bf16")
            shutil.rmtree(model)
            os.sync()
    result(res)


def train(a, py, w, model, prep, hs):
    """Stages 03 and 04 with default settings; how long stage 04 takes to exit after its last line."""
    run([py, "03_build_vocab_mapping.py", "--prepared-data", prep, "--draft-vocab-size", "8192", "--output-dir",
         f"{w}/vocab"], f"{a.out}/k_03.log")
    t0 = time.time()
    proc = subprocess.Popen([py, "04_train.py", "--model-path", model, "--prepared-data", prep, "--hidden-states", hs,
                             "--vocab-mapping", f"{w}/vocab", "--output-dir", f"{w}/ckpt", "--epochs", "1",
                             "--max-steps", str(a.train_steps), "--log-every", "5"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last_line_at, lines = None, []
    with open(f"{a.out}/k_04.log", "w") as log:  # as it comes: a call cut short still brings the log back
        for line in proc.stdout:
            lines.append(line)
            log.write(line)
            log.flush()
            last_line_at = time.time()
    proc.wait()
    tr = {"returncode": proc.returncode, "wall_s": round(time.time() - t0, 1),
          "exit_after_last_line_s": round(time.time() - last_line_at, 1) if last_line_at else None,
          "loss_choice": [l.strip() for l in lines if "loss implementation" in l][:1],
          "step_lines": [l.strip() for l in lines if " tok/s" in l and "step " in l][-2:]}
    return tr


if __name__ == "__main__":
    main()
