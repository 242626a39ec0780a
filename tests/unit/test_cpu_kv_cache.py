"""The KV cache a vLLM engine on a CPU gets (engine.cpu_kv_cache_bytes): vLLM-CPU fills all of it before it answers,
so it is sized to what the engine can hold at once, never less, and never more than the 2 GiB it had before. That
vLLM starts and serves with it: tests/e2e/test_evaluate.py (a draft) and tests/e2e/test_extract.py (stage 02)."""
import json

from eagle3pipe.engines import engine

SMOLLM2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}
DEEPSEEK_V3 = {"hidden_size": 7168, "num_attention_heads": 128, "num_hidden_layers": 61, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128}
QWEN3_4B = {"hidden_size": 2560, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "num_hidden_layers": 36}


def exact(cfg, tokens, layers):
    """What a GQA cache holds in float32: keys and values of every KV head."""
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return tokens * layers * 2 * heads * head_dim * 4


def test_the_cache_holds_twice_what_the_engine_can_hold_at_once_and_at_most_2_gib(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    for cfg in (SMOLLM2, QWEN3_4B):
        for seqs, length, k in ((1, 157, 3), (4, 2049, 1), (2, 513, 5)):
            got = engine.cpu_kv_cache_bytes(cfg, length, seqs, spec_tokens=k)
            want = 2 * exact(cfg, seqs * (length + k), cfg["num_hidden_layers"] + 4)
            assert got >= min(want, engine.CPU_KV_CACHE_CAP) and got <= engine.CPU_KV_CACHE_CAP, (cfg, seqs, length)
    # stage 05 at batch 1 on the embedded verifier: a few hundred MiB at most, not 2 GiB
    assert engine.cpu_kv_cache_bytes(SMOLLM2, 157, 1, spec_tokens=3) < 256 << 20
    # MLA's latent cache (kv_lora_rank + rope per token) is far narrower than the model: the bound covers it
    latent = 157 * 65 * (512 + 64) * 4
    assert engine.cpu_kv_cache_bytes(DEEPSEEK_V3, 157, 1, spec_tokens=3) >= 2 * latent
    # a small MLA model (the tests' random DeepSeek-V3: width 256, latent 512 + 64): the latent decides
    small = dict(DEEPSEEK_V3, hidden_size=256, num_attention_heads=4, num_hidden_layers=8, head_dim=64)
    assert engine.cpu_kv_cache_bytes(small, 157, 1, spec_tokens=3) >= 2 * 160 * 12 * (512 + 64) * 4
    # vLLM's default of 256 sequences (the online engine gives none): the old 2 GiB
    assert engine.cpu_kv_cache_bytes(SMOLLM2, 4096, 256) == engine.CPU_KV_CACHE_CAP


def test_a_draft_wider_or_deeper_than_four_verifier_layers_is_counted(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    wide = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 8}
    got = engine.cpu_kv_cache_bytes(SMOLLM2, 157, 1, wide, spec_tokens=3)
    assert got >= 2 * exact(SMOLLM2, 160, 30) + 2 * exact(wide, 160, 8)


def test_the_user_s_setting_wins_and_the_engine_reads_its_draft_s_config(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert engine.cpu_kv_cache_bytes(SMOLLM2, 157, 1) == 3 << 30
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")  # empty: unset, for vLLM too
    assert engine.cpu_kv_cache_bytes(SMOLLM2, 157, 1) < 256 << 20
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    verifier, draft = tmp_path / "verifier", tmp_path / "draft"
    verifier.mkdir()
    draft.mkdir()
    (verifier / "config.json").write_text(json.dumps(SMOLLM2))
    layer = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 12}
    (draft / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3",
                                                   "transformer_layer_config": layer}))
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    with_draft = engine._cpu_kv_cache(str(verifier), 157, {"speculative_config": spec, "max_num_seqs": 1})
    assert with_draft == engine.cpu_kv_cache_bytes(SMOLLM2, 157, 1, layer, 3)
    # a draft folder without a readable config: the bound assumes four layers as wide as the verifier
    (draft / "config.json").write_text("{")
    unread = engine._cpu_kv_cache(str(verifier), 157, {"speculative_config": spec, "max_num_seqs": 1})
    assert unread == engine.cpu_kv_cache_bytes(SMOLLM2, 157, 1, None, 3) and unread < with_draft
