"""What the benchmarks share: running a command and timing it, random verifiers of a given shape (this measures speed,
not quality), stage 02 as a child process, the bare forward it is measured against, and the RESULT line.

Run every benchmark from the repository root as a module, e.g. `.venv/bin/python -m bench.bench_train ...`: the
package and bench/ then import without any change to sys.path.
"""
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def result(obj):
    """The one machine-readable line a benchmark prints: `RESULT {json}`."""
    print("RESULT", json.dumps(obj), flush=True)


def run(cmd, log, env=None):
    """Run `cmd` in the repository root, its output to `log`; stop with its tail on failure. -> (process, seconds)."""
    t0 = time.time()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    open(log, "w").write(p.stdout + p.stderr)
    if p.returncode:
        print((p.stdout + p.stderr)[-4000:])
        raise SystemExit(f"{cmd[1]} failed ({p.returncode})")
    return p, time.time() - t0


LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False, "max_position_embeddings": 8192}


KIMI = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=64,
            num_key_value_heads=64, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
            max_position_embeddings=8192, tie_word_embeddings=False)


def llama_8b(assets, dst):
    """Llama-3.1-8B's shapes with random weights and the tokenizer of `assets`, saved to `dst` (once)."""
    from transformers import AutoConfig
    if os.path.exists(os.path.join(dst, "config.json")):
        return
    cfg = AutoConfig.from_pretrained(assets)
    for k, v in LLAMA_8B.items():
        setattr(cfg, k, v)
    save_random(cfg, assets, dst)


def deepseek_v3(assets, dst, layers, experts, topk):
    """A DeepSeek-V3 at Kimi-K2.5's width with random weights and the tokenizer of `assets`, saved to `dst` (once)."""
    from transformers import DeepseekV3Config
    if os.path.exists(os.path.join(dst, "config.json")):
        return
    vocab = json.load(open(os.path.join(assets, "config.json")))["vocab_size"]
    cfg = DeepseekV3Config(vocab_size=vocab, num_hidden_layers=layers, n_routed_experts=experts,
                           num_experts_per_tok=topk, **KIMI)
    save_random(cfg, assets, dst, topk_method="noaux_tc", scoring_func="sigmoid")
    os.sync()  # the weights' writeback must not compete with the first run's files


def save_random(cfg, assets, dst, **config_extra):
    """Random bf16 weights of `cfg`, drawn on the GPU (the CPU where there is none), saved to `dst` with the tokenizer
    files of `assets`."""
    import json
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
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
