"""Benchmark: stage 02 (HF backend) on NVIDIA GPUs against a bare forward of the same batches, bf16 and fp8
storage (bf16 with the default 4 writer threads and with 8), and (with 2+ GPUs) two `--shard` replicas against one.

    python bench/bench_extract_gpu.py --assets .gpu --work /tmp/w [--num-samples 1000] [--batch-size 8]

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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False, "max_position_embeddings": 8192}


def make_verifier(assets, dst):
    from transformers import AutoConfig
    if os.path.exists(os.path.join(dst, "config.json")):
        return
    cfg = AutoConfig.from_pretrained(assets)
    for k, v in LLAMA_8B.items():
        setattr(cfg, k, v)
    save_random(cfg, assets, dst)


def save_random(cfg, assets, dst, **config_extra):
    """Random bf16 weights of `cfg`, drawn on the GPU, saved to `dst` with the tokenizer files of `assets`."""
    import json
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(dst)
    del model
    torch.cuda.empty_cache()
    if config_extra:  # fields vLLM reads that transformers' config class does not keep
        c = json.load(open(os.path.join(dst, "config.json")))
        json.dump({**c, **config_extra}, open(os.path.join(dst, "config.json"), "w"), indent=2)
    for n in os.listdir(assets):
        if n.startswith(("tokenizer", "chat_template", "special_tokens", "generation")):
            shutil.copy(os.path.join(assets, n), dst)


def stage02(model, prep, out, *extra, gpus="0"):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus)
    cmd = [sys.executable, "02_extract_hidden_states.py", "--backend", "hf", "--model-path", model,
           "--prepared-data", prep, "--output-dir", out, *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait(p, name):
    out = p.communicate()[0]
    if p.returncode != 0:
        print(out[-3000:])
        raise SystemExit(f"{name} failed ({p.returncode})")
    return out


def batch_tensors(rows, b):
    """The rows `b` as right-padded [B, T] input ids and attention mask (CPU)."""
    import torch
    t = max(len(rows[i]) for i in b)
    ids = torch.zeros(len(b), t, dtype=torch.long)
    mask = torch.zeros(len(b), t, dtype=torch.long)
    for k, i in enumerate(b):
        ids[k, : len(rows[i])] = torch.as_tensor(rows[i])
        mask[k, : len(rows[i])] = 1
    return ids, mask


def bare_forward(model_path, rows, batches, per_batch=None):
    """Seconds for all `batches` through the bare model, after one untimed warm-up batch (the first, longest one:
    kernels compile and caches fill there, in this process as in stage 02's). `per_batch`, a list, receives each
    batch's (seconds, tokens)."""
    import torch
    from transformers import AutoModel
    model = AutoModel.from_pretrained(model_path, dtype=torch.bfloat16, device_map={"": "cuda"}).eval()
    torch.cuda.synchronize()
    t0 = time.time()
    with torch.inference_mode():
        for n, b in enumerate([batches[0]] + list(batches)):
            if n == 1:
                torch.cuda.synchronize()
                t0 = t_prev = time.time()
            ids, mask = batch_tensors(rows, b)
            model(input_ids=ids.cuda(non_blocking=True), attention_mask=mask.cuda(non_blocking=True), use_cache=False)
            if per_batch is not None and n >= 1:
                torch.cuda.synchronize()
                per_batch.append((time.time() - t_prev, sum(len(rows[i]) for i in b)))
                t_prev = time.time()
    torch.cuda.synchronize()
    secs = time.time() - t0
    del model
    torch.cuda.empty_cache()
    return secs


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
    sys.path.insert(0, REPO)
    from eagle3pipe.extraction import make_batches
    ngpu = torch.cuda.device_count()
    w, py = a.work, sys.executable
    model, prep = f"{w}/verifier", f"{w}/prep"
    t0 = time.time()
    make_verifier(a.assets, model)
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
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
