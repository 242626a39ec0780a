"""Benchmark: stage 02 (HF backend) on NVIDIA GPUs against a bare forward of the same batches, bf16 and fp8
storage (bf16 with the default 4 writer threads and with 8), and (with 2+ GPUs) two `--shard` replicas against one.

    python -m bench.bench_extract_gpu --assets .gpu --work /tmp/w [--num-samples 1000] [--batch-size 8]

--assets holds the tokenizer files and config.json of a small Llama (SmolLM2 here) and train.json (ShareGPT).
The verifier is that config reshaped to Llama-3.1-8B (32 layers, hidden 4096, 32/8 heads, MLP 14336) with random
bf16 weights, saved to --work (local disk): this measures speed, not quality. Its vocabulary stays the tokenizer's.
Every number excludes model load: stage 02's own manifest (first batch to last file written) and, in this
process, the same longest-first batches through AutoModel with no hooks, timed to the last synchronize.
Prints one RESULT line (JSON).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from bench.common import REPO, bare_forward, llama_8b, result, stage02, wait


def compare(a, b, rows, n=50):
    """Token ids equal; hidden states of the first n files: bit-identical count and the worst relative error."""
    import torch
    from safetensors.torch import load_file
    same, worst = 0, 0.0
    for i in range(min(n, len(rows))):
        x, y = load_file(f"{a}/hs_{i}.safetensors"), load_file(f"{b}/hs_{i}.safetensors")
        assert torch.equal(x["token_ids"], y["token_ids"])
        same += torch.equal(x["hidden_states"], y["hidden_states"])
        d = (x["hidden_states"].float() - y["hidden_states"].float()).norm() / y["hidden_states"].float().norm()
        worst = max(worst, d.item())
    return {"compared": min(n, len(rows)), "bit_identical": same, "worst_rel_error": worst}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--assets", required=True)
    ap.add_argument("--work", default="/tmp/w")
    ap.add_argument("--num-samples", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=8)
    a = ap.parse_args()
    import torch
    from eagle3pipe.extract.extraction import make_batches
    ngpu = torch.cuda.device_count()
    w, py = a.work, sys.executable
    model, prep = f"{w}/verifier", f"{w}/prep"
    t0 = time.time()
    llama_8b(a.assets, model)
    made = time.time() - t0
    # the verifier's 16 GB were just written: flush them now, or their writeback competes with the first run's
    # files (the first bf16 run measured 0.73-0.88x with this, 0.96-0.99x on a flushed disk)
    os.sync()
    p = subprocess.run([py, "01_prepare_dataset.py", "--model-path", model, "--dataset", f"{a.assets}/train.json",
                        "--num-samples", str(a.num_samples), "--max-seq-len", "2048", "--output-dir", prep],
                       cwd=REPO, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"stage 01 failed: {p.stdout[-2000:]} {p.stderr[-2000:]}")
    rows = [json.loads(l)["input_ids"] for l in open(f"{prep}/tokenized_data.jsonl")]
    tokens = sum(map(len, rows))
    bs = ["--batch-size", str(a.batch_size)]
    res = {"gpus": ngpu, "gpu": torch.cuda.get_device_name(0), "samples": len(rows), "tokens": tokens,
           "batch_size": a.batch_size, "verifier_create_s": round(made, 1)}

    def tps(out):
        m = json.load(open(f"{out}/manifest.json"))
        return m["throughput"]["tokens_per_s"], m["throughput"]["seconds"]

    wait(stage02(model, prep, f"{w}/hs_bf16", *bs), "stage 02 bf16")
    res["stage02_bf16_tok_s"], secs_one = tps(f"{w}/hs_bf16")
    wait(stage02(model, prep, f"{w}/hs_w8", *bs, "--writer-threads", "8"), "stage 02 bf16, 8 writer threads")
    res["stage02_bf16_8_writers_tok_s"], _ = tps(f"{w}/hs_w8")
    shutil.rmtree(f"{w}/hs_w8")
    os.sync()
    wait(stage02(model, prep, f"{w}/hs_fp8", *bs, "--storage-dtype", "fp8"), "stage 02 fp8")
    res["stage02_fp8_tok_s"], _ = tps(f"{w}/hs_fp8")
    du = lambda d: sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.startswith("hs_"))
    res["disk_gb_bf16"], res["disk_gb_fp8"] = round(du(f"{w}/hs_bf16") / 1e9, 2), round(du(f"{w}/hs_fp8") / 1e9, 2)
    shutil.rmtree(f"{w}/hs_fp8")
    batches = make_batches(range(len(rows)), [len(r) for r in rows], a.batch_size)
    bare = tokens / bare_forward(model, rows, batches)
    res["bare_forward_tok_s"] = round(bare, 1)
    res["ratio_bf16"] = round(res["stage02_bf16_tok_s"] / bare, 3)
    res["ratio_bf16_8_writers"] = round(res["stage02_bf16_8_writers_tok_s"] / bare, 3)
    res["ratio_fp8"] = round(res["stage02_fp8_tok_s"] / bare, 3)
    if ngpu >= 2:  # two replicas, one GPU each, one output folder
        t = time.time()
        ps = [stage02(model, prep, f"{w}/hs_sh", *bs, "--shard", f"{k}/2", gpus=str(k)) for k in range(2)]
        logs = [wait(p, f"shard {k}/2") for k, p in enumerate(ps)]
        res["two_replicas_wall_incl_load_s"] = round(time.time() - t, 1)
        shard_secs = [json.load(open(f"{w}/hs_sh/.shard-{k}-of-2.json"))["seconds"] for k in range(2)]
        res["one_replica_s"], res["two_replicas_s"] = round(secs_one, 1), round(max(shard_secs), 1)
        res["replica_speedup"] = round(secs_one / max(shard_secs), 2)
        res["two_replicas_manifest_complete"] = json.load(open(f"{w}/hs_sh/manifest.json"))["complete"]
        res["two_vs_one_files"] = compare(f"{w}/hs_sh", f"{w}/hs_bf16", rows)
        print(logs[1][-600:])
    result(res)


if __name__ == "__main__":
    main()
