"""The MLA draft (`04_train.py --draft-arch deepseek`): one EAGLE-3 decoder layer with DeepSeek-V3's multi-head
latent attention and a dense MLP, for DeepSeek-V3 / Kimi verifiers, served by vLLM as `Eagle3DeepseekV3ForCausalLM`.

- The layer is built inside speculators' Eagle3 model: transformers' `DeepseekV3DecoderLayer` with speculators'
  EAGLE-3 first-layer forward (`Eagle3FirstLayerMixin`: [embeddings | hidden states] in, 2 x hidden wide), its
  two input projections (`q_a_proj`, `kv_a_proj_with_mqa`) widened to take that input. mla_draft.layer
  puts it into speculators' map from a layer config's `model_type` to its classes, for the run only.
- Its shape comes from the verifier (`text_config` included): heads, kv/q latent ranks, rope / nope / v head dims,
  rope settings. The draft's own choices: as many KV heads as heads (MLA expands its latent to every head), a dense
  MLP, no biases, GPT-J (interleaved) rope as vLLM's MLA applies it, the latent norms' eps = rms_norm_eps (vLLM's).
- The weight names are transformers' DeepSeek-V3 names, which vLLM's loader maps (`q_a_proj` and
  `kv_a_proj_with_mqa` into its fused projection, `gate_proj`/`up_proj` into `gate_up_proj`): speculators' normal
  save writes what vLLM reads. vLLM 0.32 reads a speculators-format config only for llama and qwen3 layers, so each
  checkpoint also gets `vllm/`: a native config (architecture `Eagle3DeepseekV3ForCausalLM`) beside a hard link to
  the same weights. That folder is what the serve command and stage 05 give vLLM.
"""
import json
import os

from ..adapters import draft_layer
from ..storage import files, outdir

MODEL_TYPE = "deepseek_v3"  # the draft layer config's model_type: transformers' DeepseekV3Config
SERVED = "vllm"  # <checkpoint>/vllm: what vLLM loads
# the verifier's keys the draft layer takes (nothing else: never its quantization, MoE, indexer or remote code)
KEYS = ("hidden_size", "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
        "v_head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
        "initializer_range", "vocab_size")


def is_mla(text_cfg):
    return bool(text_cfg.get("kv_lora_rank"))


def layer_config(text_cfg, num_layers):
    """The draft's decoder-layer config (a DeepseekV3Config as a dict) from the verifier's text config."""
    cfg = {k: text_cfg[k] for k in KEYS if text_cfg.get(k) is not None}
    hidden = cfg["hidden_size"]
    intermediate = text_cfg.get("intermediate_size") or 3 * hidden  # the verifier's dense MLP width
    rope = cfg.pop("rope_parameters", None) or cfg.pop("rope_scaling", None)
    cfg.pop("rope_scaling", None)
    if rope:
        rope = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": rope.get("rope_type") or rope.get("type")}
        if "rope_theta" in cfg:
            rope.setdefault("rope_theta", cfg["rope_theta"])
        cfg["rope_parameters"] = rope
    cfg.update(model_type=MODEL_TYPE, num_hidden_layers=num_layers, num_key_value_heads=cfg["num_attention_heads"],
               intermediate_size=intermediate, hidden_act="silu", attention_bias=False, rope_interleave=True,
               first_k_dense_replace=num_layers, tie_word_embeddings=False,
               # vLLM's MLA needs a q latent (its loader fuses q_a_proj with kv_a_proj_with_mqa): a verifier without one
               # (DeepSeek-V2-Lite) gives its draft one
               q_lora_rank=cfg.get("q_lora_rank") or min(1536, hidden))
    return cfg


def misfit(text_cfg):
    """Why this verifier cannot take the MLA draft, or None."""
    if not is_mla(text_cfg):
        return "the verifier has no MLA attention (no kv_lora_rank in its config)"
    return refusal(text_cfg)


def refusal(text_cfg):
    """Why the verifier's rope cannot be trained and served alike (None when it can): HF and vLLM scale YaRN's
    attention the same way only with both `mscale` and `mscale_all_dim`, or neither, and without `attention_factor`."""
    rope = text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type")) in (None, "default"):
        return None
    if ("mscale" in rope) != ("mscale_all_dim" in rope):
        return "its rope settings give only one of mscale / mscale_all_dim, which transformers and vLLM scale apart"
    if "attention_factor" in rope:
        return "its rope settings give attention_factor, which transformers and vLLM apply apart"
    return None


def components():
    """speculators' ModelComponents for the MLA draft (imports torch, transformers and speculators)."""
    import torch
    from speculators.models.base_components import ModelComponents
    from speculators.models.eagle3.model_definitions import Eagle3FirstLayerMixin
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer, DeepseekV3MLP, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding)

    class DeepseekV3DecoderEagle3FirstLayer(Eagle3FirstLayerMixin, DeepseekV3DecoderLayer):
        """EAGLE-3's first layer: the mixin's forward (norms on each half of [embeddings | hidden], attention over the
        concatenation [1, L, 2H], residual from the hidden half), MLA attention widened to that input."""

        def __init__(self, config, layer_idx, norm_before_residual=False):
            super().__init__(config, layer_idx)
            if not isinstance(self.mlp, DeepseekV3MLP):
                self.mlp = DeepseekV3MLP(config)
            eps, wide, attn = config.rms_norm_eps, 2 * config.hidden_size, self.self_attn
            self.norm_before_residual = norm_before_residual
            self.hidden_norm = DeepseekV3RMSNorm(config.hidden_size, eps=eps)
            attn.q_a_proj = torch.nn.Linear(wide, config.q_lora_rank, bias=False)
            attn.q_a_layernorm = DeepseekV3RMSNorm(config.q_lora_rank, eps=eps)
            attn.kv_a_proj_with_mqa = torch.nn.Linear(wide, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
            attn.kv_a_layernorm = DeepseekV3RMSNorm(config.kv_lora_rank, eps=eps)

    return ModelComponents(DeepseekV3DecoderEagle3FirstLayer, DeepseekV3DecoderLayer, DeepseekV3RMSNorm,
                           DeepseekV3RotaryEmbedding)


def served_config(ckpt_cfg):
    """vLLM's native config for a saved MLA draft (`ckpt_cfg`: its speculators config.json)."""
    layer = dict(ckpt_cfg["transformer_layer_config"])
    ids = ckpt_cfg.get("eagle_aux_hidden_state_layer_ids")
    cfg = {k: v for k, v in layer.items() if k not in ("architectures", "transformers_version", "auto_map")}
    # deepseek_v2: vLLM turns a deepseek_v3 draft config into its MTP model's (DeepSeekMTPModel) before reading it
    cfg.update(model_type="deepseek_v2", architectures=["Eagle3DeepseekV3ForCausalLM"],
               draft_vocab_size=ckpt_cfg.get("draft_vocab_size"),
               norm_before_residual=bool(ckpt_cfg.get("norm_before_residual", True)),
               fc_norm=bool(ckpt_cfg.get("fc_norm")), norm_output=bool(ckpt_cfg.get("norm_output")),
               eagle_aux_hidden_state_layer_ids=ids, eagle_config={"eagle_aux_hidden_state_layer_ids": ids},
               num_aux_hidden_states=len(ids) if ids else 3)
    if ckpt_cfg.get("target_hidden_size"):
        cfg["target_hidden_size"] = ckpt_cfg["target_hidden_size"]
    return cfg


def write_served(ckpt):
    """<ckpt>/vllm: the native config and a hard link to the checkpoint's weights (one copy on disk). Written through
    outdir (temporary name, rename, recorded). A speculators checkpoint of another layer gets nothing."""
    with open(os.path.join(ckpt, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if (cfg.get("transformer_layer_config") or {}).get("model_type") != MODEL_TYPE:
        return None
    served = outdir.make_dir(os.path.join(ckpt, SERVED))
    files.write_json(os.path.join(served, "config.json"), served_config(cfg))
    outdir.link_file(os.path.join(ckpt, "model.safetensors"), os.path.join(served, "model.safetensors"))
    return served


def is_mla_checkpoint(ckpt):
    try:
        with open(os.path.join(ckpt, "config.json"), encoding="utf-8") as f:
            return (json.load(f).get("transformer_layer_config") or {}).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def served_path(ckpt):
    """What to give vLLM for a stage 04 checkpoint: its `vllm/` folder when it has one, else the checkpoint."""
    p = os.path.join(ckpt, SERVED)
    return p if os.path.isfile(os.path.join(p, "config.json")) else ckpt


def layer():
    """adapters.draft_layer for the MLA draft: its classes in speculators' map for the block."""
    return draft_layer(MODEL_TYPE, components)
