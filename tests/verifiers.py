"""Small random verifiers of the architecture classes the pipeline is for, made from transformers' own configs (no
download): DeepSeek-V3 (MLA attention with DeepSeek's real widths, a mixture of experts with `noaux_tc` routing), and
the multimodal wrapper shape whose language model's config sits under `text_config`, and Kimi-K2.5's format as it
ships (INT4 routed experts, a tokenizer that needs remote code). They reuse the embedded SmolLM2's tokenizer, so
stage 01 and the held-out prompts work unchanged."""
import json
import os
import shutil

from eagle3pipe.verifier.verifier import TOKENIZER_FILES


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



# Kimi-K2.5's quantization_config as it ships (under its text_config): INT4, symmetric, groups of 32, by
# compressed-tensors' pack-quantized format; attention, shared experts, the dense MLPs and the head stay bf16
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
ROUTED_EXPERT = r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"


def int4_experts(out, src, group=32, nest=False):
    """`src` (a saved DeepSeek-V3: deepseek_v3()) with its routed experts quantized as Kimi-K2.5 ships them, by
    compressed-tensors' own pack-quantized compressor (its min-max scales), everything else kept bf16, and a tokenizer
    that needs remote code (a local class beside the weights, as Kimi's tiktoken one is). nest: the config as
    Kimi-K2.5 nests it, its text model and quantization_config under `text_config` of a kimi_k25 wrapper (the
    tensors keep the text model's names). -> out."""
    import re
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file
    os.makedirs(out, exist_ok=True)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group,
                            dynamic=False, observer="minmax")
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    qcfg = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=KIMI_IGNORE,
                              quantization_status="compressed")
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    tensors = {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        if not re.match(ROUTED_EXPERT, name):
            tensors[name] = w
            continue
        g = w.float().unflatten(-1, (-1, group))  # [out, in / group, group]
        scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args)
        module = name[:-len(".weight")]
        for part, t in compressor.compress({"weight": w, "weight_scale": scale.to(torch.bfloat16)}, scheme).items():
            tensors[f"{module}.{part}"] = (t.to(torch.int32) if part == "weight_shape" else t).contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "compressed-tensors",
                                  **qcfg.model_dump(exclude={"quant_method"}, mode="json")}
    if nest:
        cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": cfg,
               "vision_config": {"hidden_size": 64}, "media_placeholder_token_id": 1}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    remote_code_tokenizer(out, src)
    return out


TOKENIZER_CODE = '''from transformers import PreTrainedTokenizerFast


class KimiLikeTokenizer(PreTrainedTokenizerFast):
    """A tokenizer class shipped beside the weights, as Kimi-K2.5's tiktoken one is: loads only with remote code."""
    RAISE = False

    def __init__(self, *args, **kwargs):
        if self.RAISE:
            raise RuntimeError("tiktoken.model: bad rank file")
        super().__init__(*args, **kwargs)
'''


def remote_code_tokenizer(out, src, raises=False):
    """`src`'s tokenizer files in `out`, its tokenizer_config.json naming a class in `out` (auto_map), as a model
    whose tokenizer needs trust_remote_code ships it; raises: the class raises when it loads."""
    _tokenizer(src, out)
    with open(os.path.join(out, "tokenization_kimi_like.py"), "w") as f:
        f.write(TOKENIZER_CODE.replace("RAISE = False", f"RAISE = {raises}"))
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        tok = json.load(f)
    tok.update(tokenizer_class="KimiLikeTokenizer",
               auto_map={"AutoTokenizer": [None, "tokenization_kimi_like.KimiLikeTokenizer"]})
    with open(path, "w") as f:
        json.dump(tok, f, indent=2)


def dense(out, tokenizer_from, config_class, layers=8, hidden=64, heads=4, seed=0, **extra):
    """A small random verifier of any dense transformers family (`config_class`: "Gemma2Config", "Phi3Config", ...)
    with the embedded SmolLM2's tokenizer: for the checks an architecture's config decides, before anything loads."""
    import torch
    import transformers
    os.makedirs(out, exist_ok=True)
    base = _tokenizer(tokenizer_from, out)
    cfg = getattr(transformers, config_class)(**{
        "vocab_size": base["vocab_size"], **extra}, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=4096,
        bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # norms random too: a family's own norm (Gemma's x * (1 + w)) shows only where w is not 0
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(out)
    return out


def gemma3(out, tokenizer_from):
    """A random 8-layer Gemma 3 (three sliding-window layers to one full, norm weights random: its own norm,
    `x * (1 + w)`, differs from speculators' only where w is not 0)."""
    return dense(out, tokenizer_from, "Gemma3TextConfig", layers=8, head_dim=16, sliding_window=64,
                 layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2)


def stage04_plan(model, d, out):
    """Stage 04's plan (every check, the targets' included) on stages 01-03's folders `d`, in this process."""
    from conftest import load_script
    from eagle3pipe.train import train_plan
    args = load_script("04_train.py").parse_args(
        ["--model-path", str(model), "--prepared-data", str(d["prepared"]), "--hidden-states", str(d["hs"]),
         "--vocab-mapping", str(d["vocab"]), "--output-dir", str(out), "--total-seq-len", "1024",
         "--measure-prompts", "0"])
    return train_plan.plan(args, 0)


def stages_01_to_03(model, root):
    """Stages 01 (8 rows), 02 (HF, float32) and 03 (1,024 tokens) on `model` under `root` -> their folders."""
    from conftest import run_script
    d = {k: root / k for k in ("prepared", "hs", "vocab")}
    for argv in (["01_prepare_dataset.py", "--model-path", model, "--num-samples", "8", "--max-seq-len", "256",
                  "--output-dir", str(d["prepared"])],
                 ["02_extract_hidden_states.py", "--backend", "hf", "--model-path", model, "--prepared-data",
                  str(d["prepared"]), "--output-dir", str(d["hs"]), "--max-seq-len", "256", "--dtype", "float32"],
                 ["03_build_vocab_mapping.py", "--prepared-data", str(d["prepared"]), "--draft-vocab-size", "1024",
                  "--output-dir", str(d["vocab"])]):
        p, _ = run_script(*argv)
        assert p.returncode == 0, p.stderr[-3000:]
    return d
