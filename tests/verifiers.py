"""Small random verifiers of the architecture classes the pipeline is for, made from transformers' own configs (no
download): DeepSeek-V3 (MLA attention with DeepSeek's real widths, a mixture of experts with `noaux_tc` routing), and
the multimodal wrapper shape whose language model's config sits under `text_config`. They reuse the embedded
SmolLM2's tokenizer, so stage 01 and the held-out prompts work unchanged."""
import json
import os
import shutil

from eagle3pipe.verifier import TOKENIZER_FILES


def _tokenizer(src, out):
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(out, name))
    with open(os.path.join(src, "config.json")) as f:
        base = json.load(f)
    return base


# Kimi-K2.5's rope (its config's rope_scaling): YaRN, factor 64, mscale = mscale_all_dim = 1
KIMI_ROPE = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
             "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096}


def deepseek_v3(out, tokenizer_from, layers=8, hidden=256, experts=8, topk=2, heads=4, seed=0):
    """A random DeepSeek-V3: MLA with latent 512, rope 64, nope 128, v 128 (the CPU MLA kernels take only the real
    head sizes), Kimi-K2.5's rope (YaRN to 262,144 positions), `experts` routed experts plus one shared, top-`topk`
    routing with `noaux_tc` (vLLM builds the router's correction bias only then), the first layer dense."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config
    os.makedirs(out, exist_ok=True)
    base = _tokenizer(tokenizer_from, out)
    cfg = DeepseekV3Config(
        vocab_size=base["vocab_size"], hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, n_shared_experts=1,
        n_routed_experts=experts, num_experts_per_tok=topk, n_group=1, topk_group=1, kv_lora_rank=512,
        q_lora_rank=hidden, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=1,
        max_position_embeddings=262144, rope_parameters=KIMI_ROPE, tie_word_embeddings=False,
        bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"), rope_interleave=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    saved.update(topk_method="noaux_tc", scoring_func="sigmoid", architectures=["DeepseekV3ForCausalLM"])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    return out


def wrapped_text_config(out, inner):
    """The config shape of a multimodal wrapper (Kimi-K2.5, Llava, ...): the language model's config under
    `text_config`, the top level holding only the wrapper's own fields. Files other than config.json are linked."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(inner):
        if name != "config.json":
            os.symlink(os.path.join(inner, name), os.path.join(out, name))
    with open(os.path.join(inner, "config.json")) as f:
        text = json.load(f)
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": text, "vision_config": {"hidden_size": 64}, "media_placeholder_token_id": 1}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(wrapper, f, indent=2)
    return out

