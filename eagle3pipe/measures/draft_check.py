"""Stage 05's preflight: each draft folder and the generation flags checked against the verifier and the device,
before anything heavy is imported and before the output folder is taken (vLLM would take 7-50 s here, 22 minutes on
Kimi, to fail on any of them). JSON and safetensors headers only: no torch, no transformers.

- `check_run`: the flags against the verifier and the device: --max-new-tokens + --num-speculative-tokens against
  the verifier's positions (the prompts' own lengths come later: `max_model_len`, after the tokenizer), --tp-size
  against the visible GPUs and the verifier's heads.
- `check_folder`: every field of a draft's config.json (types, ranges, the verifier's sizes and layer ids), then its
  weights (draft_weights.py: the safetensors headers, every tensor's shape against the config, the layer count, the
  vocabulary map).
The layer-id convention is verifier.py's: ids 0..n, n = the last decoder layer's output; vLLM captures the auxiliary
states in layer order (interfaces._maybe_add_hidden_state), so the ids must ascend.
"""
import json
import math
import os

from ..base import devices
from ..base.errors import UsageError
from ..drafts import draft_weights
from ..storage.files import read_json
from ..verifier import quantization
from ..verifier.verifier import check_weights, same_verifier

MAX_DRAFT_LAYERS = 32      # stage 04's --num-layers cap (settings.Train)
LAYER_TYPES = ("llama", "qwen3", "deepseek_v3")  # what stage 04 trains and vLLM serves as an eagle3 draft
DTYPE_NAMES = ("bfloat16", "float16", "float32")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")  # transformers 5's
# The keys vLLM's get_rope reads with [] for each type (a KeyError after the verifier loaded). Not listed:
# original_max_position_embeddings, which transformers' standardize_rope_params fills from max_position_embeddings
# (required below) for llama3, yarn and longrope before vLLM reads it.
ROPE_KEYS = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "longrope": ("short_factor", "long_factor")}
ARCHITECTURES = ["Eagle3DraftModel"]  # what speculators' save writes; vLLM maps the layer's model_type itself
# vLLM's eagle3 layers build their MLP with LlamaMLP, Qwen3MLP (qwen2's) or DeepseekV2MLP: each raises on any
# activation but silu
ACTIVATIONS = {"llama": ("silu",), "qwen3": ("silu",), "deepseek_v3": ("silu",)}
# The projections each vLLM eagle3 layer gives a bias when the flag is set (Llama: q, k, v and o; Qwen3: q, k, v, its
# MLP never; DeepSeek's MLA and MLP never): the weights must then hold exactly those biases
BIASES = {"llama": {"attention_bias": ("q_proj", "k_proj", "v_proj", "o_proj"),
                    "mlp_bias": ("gate_proj", "up_proj", "down_proj")},
          "qwen3": {"attention_bias": ("q_proj", "k_proj", "v_proj")}, "deepseek_v3": {}}
ATTENTION_KINDS = ("full_attention", "sliding_attention")  # the only layer_types vLLM's eagle3 layers tell apart
RERUN = "rerun 04_train.py"
_MISSING = object()


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _show(v):
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


class _Fields:
    """Reads one config's fields, each refusal one line naming the draft, the file and the field."""

    def __init__(self, draft, cfg, where):
        self.draft, self.cfg, self.where = draft, cfg, where

    def fail(self, name, value, why):
        shown = "missing" if value is _MISSING else _show(value)
        raise UsageError(f"--draft {self.draft}: config.json {self.where}{name} {shown}: {why}; {RERUN}")

    def get(self, name, kind, required=True, lo=None, hi=None):
        v = self.cfg.get(name, _MISSING)
        if v is _MISSING or v is None:
            if required:
                self.fail(name, _MISSING, f"a stage 04 checkpoint holds it ({kind})")
            return None
        ok = {"int": _int, "number": _num, "bool": lambda x: isinstance(x, bool),
              "string": lambda x: isinstance(x, str) and x.strip() != "", "object": lambda x: isinstance(x, dict),
              "list": lambda x: isinstance(x, list)}[kind](v)
        if not ok:
            self.fail(name, v, f"expected {'an' if kind[0] in 'aeiou' else 'a'} {kind}")
        if lo is not None and v < lo or hi is not None and v > hi:
            self.fail(name, v, f"out of range: must be in [{lo}, {hi}]" if hi is not None else f"must be at least {lo}")
        return v


def check_tp(tp, gpus, flag="--tp-size"):
    """--tp-size (or stage 01's `flag`) against the visible GPUs."""
    if not gpus and tp > 1:
        raise UsageError(f"{flag} {tp}: no GPU visible; on CPU use {flag} 1")
    if gpus and tp > len(gpus):
        raise UsageError(f"{flag} {tp}: only {len(gpus)} GPU(s) visible "
                         f"({devices.visible_words()})")


def split_heads(tp, cfg):
    """The first of a config's head counts --tp-size cannot split, as (field, count), or None: vLLM splits heads across
    the GPUs (KV heads may instead be replicated when tp is a multiple of them), the verifier's and the draft's alike."""
    for what in ("num_attention_heads", "num_key_value_heads"):
        h = cfg.get(what)
        if _int(h) and h > 0 and h % tp and not (what == "num_key_value_heads" and tp % h == 0):
            return what, h
    return None


def check_run(args, fp, text_cfg, gpus):
    """The flags that do not depend on the prompts, against the verifier and the device (a quantized verifier the
    installed vLLM has no kernel for here included)."""
    check_weights(args.model_path)  # vLLM would find missing or cut weights only as it loads them
    maxpos = fp.get("max_position_embeddings")
    k, new = args.num_speculative_tokens, args.max_new_tokens
    if new < k + 2:  # the prompt's pass gives the first token; a round of k drafts needs k + 1 more
        raise UsageError(f"--max-new-tokens {new}: with --num-speculative-tokens {k}, not one full round of drafting "
                         f"fits (the first token comes from the prompt, a round takes up to {k + 1} more); give at "
                         f"least {k + 2}, far more for a figure worth reading")
    if _int(maxpos) and maxpos > 0 and new + k + 1 > maxpos:
        raise UsageError(f"--max-new-tokens {new}: with --num-speculative-tokens {k} and even a one-token prompt that "
                         f"is {new + k + 1} positions; the verifier handles {maxpos}: lower --max-new-tokens to at "
                         f"most {max(maxpos - k - 1, 0)}")
    check_tp(args.tp_size, gpus)
    bad = split_heads(args.tp_size, text_cfg)
    if bad:
        raise UsageError(f"--tp-size {args.tp_size}: must divide the verifier's {bad[0]} ({bad[1]})")
    quant = quantization.read(args.model_path)
    ok, why = quantization.kernel_here(quant, bool(gpus))
    if not ok:  # vLLM would refuse it only after loading the verifier
        raise UsageError(f"--model-path {args.model_path}: the verifier is {quant.describe()}, and {why}; run stage "
                         f"05 on a GPU machine")


def max_model_len(longest, args, maxpos, where=None):
    """vLLM's max_model_len for prompts of at most `longest` tokens (`where`: the longest one's record), refused
    when they cannot fit the verifier's positions (vLLM would refuse it only after loading)."""
    k, new = args.num_speculative_tokens, args.max_new_tokens
    need = longest + new + k
    if _int(maxpos) and maxpos > 0:
        if longest + k + 1 > maxpos:  # not even one new token: no --max-new-tokens helps
            raise UsageError(f"--prompts {where or args.prompts}: a prompt of {longest} tokens; with "
                             f"--num-speculative-tokens {k} the verifier's {maxpos} positions leave no room for an "
                             f"answer: give prompts without it")
        if need > maxpos:
            raise UsageError(f"--max-new-tokens {new}: the longest prompt ({longest} tokens) + {new} new + {k} "
                             f"speculative tokens = {need} positions; the verifier handles {maxpos}: lower "
                             f"--max-new-tokens to at most {maxpos - longest - k}, or give shorter prompts (the "
                             f"longest: {where or args.prompts})")
        return min(need + 8, maxpos)  # a little room; never past what vLLM derives from the config
    return need + 8


def check_config(draft, cfg, text_cfg, tp=1):
    """Every field of a draft's config.json that vLLM reads, against the verifier's text config. -> a summary dict
    (what the weights must hold)."""
    top = _Fields(draft, cfg, "")
    n, hidden, vocab = text_cfg["num_hidden_layers"], text_cfg["hidden_size"], text_cfg["vocab_size"]
    if top.get("speculators_model_type", "string") != "eagle3":
        top.fail("speculators_model_type", cfg["speculators_model_type"], "not an eagle3 checkpoint")
    archs = top.get("architectures", "list")
    if not archs or not all(isinstance(a, str) and a for a in archs):  # vLLM picks the class from the layer's
        # model_type; drafts of other tools name other classes here, so only the field's shape is checked
        top.fail("architectures", archs,
                 f"a list of class names (a stage 04 checkpoint says {json.dumps(ARCHITECTURES)})")
    _no_quantization(top, cfg)
    layer = top.get("transformer_layer_config", "object")
    dvocab = top.get("draft_vocab_size", "int", lo=1, hi=vocab)
    ids = top.get("eagle_aux_hidden_state_layer_ids", "list")
    if not ids or not all(_int(i) for i in ids):
        top.fail("eagle_aux_hidden_state_layer_ids", ids, "expected a non-empty list of integers")
    bad = [i for i in ids if not 0 <= i <= n]
    if bad:
        top.fail("eagle_aux_hidden_state_layer_ids", ids, f"id {bad[0]} is out of range [0, {n}] for the {n}-layer "
                 f"verifier (id k < n = input of decoder layer k, id n = the last layer's output)")
    if any(a >= b for a, b in zip(ids, ids[1:])):
        top.fail("eagle_aux_hidden_state_layer_ids", ids, "must ascend without repeats (vLLM hands the draft the "
                 "auxiliary states in layer order)")
    flags = {k: top.get(k, "bool", required=False) for k in
             ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad",
              "tie_word_embeddings")}
    if flags["norm_before_fc"] and flags["fc_norm"]:
        top.fail("fc_norm", True, "norm_before_fc is true too; the two are exclusive")
    target = top.get("target_hidden_size", "int", required=False)
    if target is not None and target != hidden:
        top.fail("target_hidden_size", target, f"the verifier's hidden size is {hidden}")
    _check_dtype(top, cfg)
    top.get("speculators_config", "object", required=False)

    f = _Fields(draft, layer, "transformer_layer_config.")
    kind = f.get("model_type", "string")
    if kind not in LAYER_TYPES:
        f.fail("model_type", kind, f"vLLM serves eagle3 drafts of {', '.join(LAYER_TYPES)} layers")
    if f.get("vocab_size", "int") != vocab:
        f.fail("vocab_size", layer["vocab_size"], f"the verifier's vocabulary is {vocab}")
    if f.get("hidden_size", "int") != hidden:
        f.fail("hidden_size", layer["hidden_size"], f"the verifier's hidden size is {hidden}")
    layers = f.get("num_hidden_layers", "int", lo=1, hi=MAX_DRAFT_LAYERS)
    heads = f.get("num_attention_heads", "int", lo=1, hi=hidden)
    f.get("intermediate_size", "int", lo=1, hi=64 * hidden)
    eps = f.get("rms_norm_eps", "number")
    if not 0 < eps < 1:
        f.fail("rms_norm_eps", eps, "must be in (0, 1)")
    vpos = text_cfg.get("max_position_embeddings")
    # vLLM sizes the draft's rotary cache by it: a huge value is memory, not a longer context
    maxpos = f.get("max_position_embeddings", "int", lo=1, hi=4 * vpos if _int(vpos) and vpos > 0 else 2**22)
    act = f.get("hidden_act", "string")  # vLLM reads config.hidden_act bare: no default behind it
    if act not in ACTIVATIONS[kind]:
        f.fail("hidden_act", act, f"vLLM's {kind} eagle3 layer supports only {', '.join(ACTIVATIONS[kind])}")
    _no_quantization(f, layer)
    for name in ("tie_word_embeddings", "use_cache"):
        f.get(name, "bool", required=False)
    biases = {}
    for name in ("attention_bias", "mlp_bias"):
        if f.get(name, "bool", required=False):
            if name not in BIASES[kind]:
                f.fail(name, True, f"vLLM's {kind} eagle3 layer has no such bias; stage 04 never sets it")
            biases[name] = BIASES[kind][name]
    if layer.get("bias") not in (None, False):  # vLLM's Llama layer reads it as attention_bias for o_proj
        f.fail("bias", layer["bias"], "not a field stage 04 writes (vLLM would expect an o_proj bias)")
    f.get("sliding_window", "int", required=False, lo=1, hi=maxpos)
    types = f.get("layer_types", "list", required=False)
    if types is not None and (len(types) != layers or not all(isinstance(t, str) for t in types)):
        f.fail("layer_types", types, f"expected one name per layer ({layers})")
    bad = next((t for t in types or () if t not in ATTENTION_KINDS), None)
    if bad is not None:
        f.fail("layer_types", types, f"unknown layer type {bad!r} (known: {', '.join(ATTENTION_KINDS)})")
    _check_dtype(f, layer, required=False)
    _check_rope(f, layer, text_cfg)
    if kind == "deepseek_v3":
        for name in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            f.get(name, "int", required=name != "q_lora_rank", lo=1, hi=64 * hidden)
    else:
        kv = f.get("num_key_value_heads", "int", required=False, lo=1, hi=heads)
        if kv is not None and heads % kv:
            f.fail("num_key_value_heads", kv, f"must divide num_attention_heads ({heads})")
        hd = f.get("head_dim", "int", required=False, lo=1, hi=hidden)
        if hd is None and hidden % heads:
            f.fail("num_attention_heads", heads, f"does not divide hidden_size ({hidden}) and no head_dim is given")
    bad = split_heads(tp, layer)
    if bad:
        f.fail(bad[0], bad[1], f"--tp-size {tp} must divide it (vLLM splits the draft's heads as the verifier's)")
    return {"ids": ids, "draft_vocab": dvocab, "layers": layers, "kind": kind, "flags": flags, "biases": biases}


def _no_quantization(f, cfg):
    """A speculators eagle3 checkpoint from stage 04 is never quantized; with this key vLLM would load it as if it
    were, and fail on its plain tensors after the verifier loaded."""
    if cfg.get("quantization_config") is not None:
        f.fail("quantization_config", cfg["quantization_config"], "a stage 04 draft is never quantized")


def _check_dtype(f, cfg, required=True):
    names = [k for k in ("dtype", "torch_dtype") if cfg.get(k) is not None]
    if not names and required:
        f.fail("dtype", _MISSING, f"a stage 04 checkpoint records its dtype (one of {', '.join(DTYPE_NAMES)})")
    for k in names:
        if cfg[k] not in DTYPE_NAMES:
            f.fail(k, cfg[k], f"expected one of {', '.join(DTYPE_NAMES)}")


def _check_rope(f, layer, text_cfg):
    """rope_parameters (transformers 5) or rope_theta + rope_scaling (4.x): a known type, a positive finite theta and
    factor. vLLM builds its rotary cache from these before any weight loads."""
    theirs = text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling") or {}
    known = ROPE_TYPES + tuple(t for t in (theirs.get("rope_type"), theirs.get("type")) if isinstance(t, str)) \
        if isinstance(theirs, dict) else ROPE_TYPES
    for key in ("rope_parameters", "rope_scaling"):
        rope = f.get(key, "object", required=False)
        if rope is None:
            continue
        sub = _Fields(f.draft, rope, f"{f.where}{key}.")
        for name in ("rope_type", "type"):
            t = sub.get(name, "string", required=False)
            if t is not None and t not in known:
                sub.fail(name, t, f"unknown rope type (known: {', '.join(known)})")
        for name in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor"):
            v = sub.get(name, "number", required=False)
            if v is not None and v <= 0:
                sub.fail(name, v, "must be positive")
        t = rope.get("rope_type", rope.get("type", "default"))
        for name in ROPE_KEYS.get(t, ()):
            if rope.get(name) is None:
                sub.fail(name, _MISSING, f"rope type {t!r} needs it (vLLM's get_rope reads it)")
        sub.get("original_max_position_embeddings", "int", required=False, lo=1)
    theta = f.get("rope_theta", "number", required=False)
    if theta is not None and theta <= 0:
        f.fail("rope_theta", theta, "must be positive")



def check_draft(draft, fp):
    """The draft folder is a speculators eagle3 checkpoint for this verifier's shapes -> its config."""
    cfg_path = os.path.join(draft, "config.json")
    if not os.path.exists(draft):  # a dangling link too
        raise UsageError(f"--draft {draft}: not found (give a stage 04 checkpoint, e.g. data/checkpoints/last)")
    if not os.path.isdir(draft):
        raise UsageError(f"--draft {draft}: a file; give the checkpoint's folder (e.g. data/checkpoints/last)")
    if not os.path.isfile(cfg_path):
        raise UsageError(f"--draft {draft}: no config.json (give a stage 04 checkpoint, e.g. data/checkpoints/last)")
    rerun = "rerun 04_train.py"
    try:  # a checkpoint cut short (disk full, a kill mid-copy) reads as bad JSON: one line, not a traceback
        cfg = read_json(cfg_path)
    except UsageError as e:
        raise UsageError(f"--draft {draft}: {e}; {rerun}")
    if not isinstance(cfg, dict):
        raise UsageError(f"--draft {draft}: {cfg_path} holds a JSON {type(cfg).__name__}, not a checkpoint "
                         f"config; {rerun}")
    if cfg.get("speculators_model_type") != "eagle3":
        raise UsageError(f"--draft {draft}: not an eagle3 speculators checkpoint ({cfg_path} has "
                         f"speculators_model_type={cfg.get('speculators_model_type')!r}); {rerun}")
    layer = cfg.get("transformer_layer_config")
    hidden = layer.get("hidden_size") if isinstance(layer, dict) else None
    if not isinstance(hidden, int):
        raise UsageError(f"--draft {draft}: {cfg_path} lacks transformer_layer_config.hidden_size; {rerun}")
    if hidden != fp["hidden_size"]:
        raise UsageError(f"--draft {draft}: hidden size {hidden}, the verifier's is {fp['hidden_size']}; "
                         f"it was trained for another verifier")
    train_manifest = os.path.join(os.path.dirname(os.path.realpath(draft)), "manifest.json")
    if os.path.isfile(train_manifest):
        try:
            man = read_json(train_manifest)
        except UsageError as e:
            raise UsageError(f"--draft {draft}: {e}; {rerun}")
        man = man if isinstance(man, dict) else {}
        mine = man.get("verifier")
        diff = same_verifier(mine if isinstance(mine, dict) else {}, fp)
        if man.get("stage") == "train" and diff:
            raise UsageError(f"--draft {draft}: trained for another verifier ({diff} differs from --model-path)")
    return cfg


def serving_mismatches(cfg, text_cfg, man):
    """What a draft's config says against the verifier's config and the stage 04 run that trained it. -> ([hard],
    [soft]): hard ones (the draft would read other inputs than it was trained on) are refused before any engine
    loads; soft ones (positions, rope) are named in the log and the report."""
    layer = cfg.get("transformer_layer_config") or {}
    hard, soft = [], []
    if layer.get("vocab_size") not in (None, text_cfg.get("vocab_size")):
        hard.append(f"vocabulary {layer.get('vocab_size')} against the verifier's {text_cfg.get('vocab_size')}")
    if man:
        if man.get("aux_layer_ids") and cfg.get("eagle_aux_hidden_state_layer_ids") != man["aux_layer_ids"]:
            hard.append(f"auxiliary layer ids {cfg.get('eagle_aux_hidden_state_layer_ids')} against the "
                        f"{man['aux_layer_ids']} stage 02 extracted for it")
        if man.get("draft_vocab_size") and cfg.get("draft_vocab_size") != man["draft_vocab_size"]:
            hard.append(f"draft vocabulary {cfg.get('draft_vocab_size')} against stage 03's {man['draft_vocab_size']}")
        for k in ("norm_before_fc", "fc_norm", "norm_output"):
            if k in (man.get("recipe") or {}) and bool(cfg.get(k)) != bool(man["recipe"][k]):
                hard.append(f"{k}={cfg.get(k)} against the {man['recipe'][k]} it was trained with")
    mine, theirs = layer.get("max_position_embeddings"), text_cfg.get("max_position_embeddings")
    if mine and theirs and mine != theirs:
        soft.append(f"max_position_embeddings {mine} against the verifier's {theirs}")
    rope = lambda c: c.get("rope_parameters") or {k: c.get(k) for k in ("rope_theta", "rope_scaling") if c.get(k)}  # noqa: E731
    if rope(layer) and rope(text_cfg) and rope(layer) != rope(text_cfg):
        soft.append(f"rope settings {rope(layer)} against the verifier's {rope(text_cfg)}")
    return hard, soft

def check_folder(draft, cfg, text_cfg, tp=1):
    """A draft folder (its config.json already read as `cfg`) checked whole: config, then weights. -> the summary."""
    summary = check_config(draft, cfg, text_cfg, tp)
    draft_weights.check(draft, cfg, summary, text_cfg)
    return summary
