"""The verifier as the pipeline sees it before loading any weights: its config, fingerprint and layer ids.

Layer-id convention (vLLM's and speculators'): with n = num_hidden_layers, id k (0 <= k < n) is the input
of decoder layer k = the output of layer k-1 (id 0 = the embedding output); id n is the output of the
last decoder layer BEFORE the final norm. The default auxiliary ids are [2, n//2, n-3]; id n is always
stored after them.
"""
import hashlib
import json
import os
import re

from .cli import UsageError

LAYER_ID_CONVENTION = ("id k < n = input of decoder layer k (0 = embedding output); id n = output of the "
                       "last decoder layer before the final norm")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model",
                   "vocab.json", "merges.txt", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _hub_file(model_path, name):
    """A file of a hub model (from the local HF cache or the hub). Only used for non-local paths."""
    try:
        from huggingface_hub import hf_hub_download
        return hf_hub_download(model_path, name)
    except Exception as e:  # offline, gated, missing: all are the operator's to fix
        raise UsageError(f"--model-path {model_path}: not a local folder and {name} could not be fetched "
                         f"from the hub ({type(e).__name__}); give a local model folder")


def model_files(model_path):
    """(config dict, folder holding the tokenizer files) for a local folder or a hub id."""
    if os.path.isdir(model_path):
        cfg_path = os.path.join(model_path, "config.json")
        if not os.path.isfile(cfg_path):
            raise UsageError(f"--model-path {model_path}: no config.json in this folder")
        folder = model_path
    elif HUB_ID.match(model_path) and not os.path.exists(model_path):
        cfg_path = _hub_file(model_path, "config.json")
        folder = os.path.dirname(cfg_path)
    else:
        raise UsageError(f"--model-path {model_path}: folder not found (and not a hub id like org/name)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{cfg_path}: not valid JSON ({e})")
    return cfg, folder


def text_config(cfg):
    """The language model's config: multimodal wrappers (Kimi-K2.5, Llava, ...) nest it in text_config."""
    return cfg.get("text_config") or cfg.get("language_config") or cfg


def fingerprint(model_path):
    """What identifies a verifier for the pipeline: shapes, vocab and a hash of the tokenizer files."""
    cfg, folder = model_files(model_path)
    tc = text_config(cfg)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if not tc.get(k)]
    if missing:
        raise UsageError(f"--model-path {model_path}: config.json lacks {', '.join(missing)}")
    h = hashlib.sha256()
    found = []
    for name in TOKENIZER_FILES:
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            found.append(name)
            h.update(name.encode())
            with open(p, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    heads = tc.get("num_attention_heads")
    return {
        "name_or_path": model_path,
        "architecture": (cfg.get("architectures") or [cfg.get("model_type")])[0],
        "model_type": tc.get("model_type") or cfg.get("model_type"),
        "num_hidden_layers": tc["num_hidden_layers"],
        "hidden_size": tc["hidden_size"],
        "vocab_size": tc["vocab_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": tc.get("num_key_value_heads") or heads,
        "max_position_embeddings": tc.get("max_position_embeddings"),
        "torch_dtype": tc.get("torch_dtype") or cfg.get("torch_dtype") or tc.get("dtype") or cfg.get("dtype"),
        "tokenizer_sha256": h.hexdigest()[:16] if found else None,
    }


# The fields that must agree between stages; name_or_path may differ (a copied or moved model).
IDENTITY = ("architecture", "num_hidden_layers", "hidden_size", "vocab_size", "tokenizer_sha256")


def same_verifier(a, b):
    """The first identity field on which two fingerprints differ, or None."""
    for k in IDENTITY:
        if a.get(k) != b.get(k):
            return k
    return None


def default_layer_ids(n):
    return [2, n // 2, n - 3]


def resolve_layer_ids(ids, n, flag="--layer-ids"):
    """Validated auxiliary ids, then id n (the last layer) appended: the order stored in every file."""
    ids = list(ids) if ids else default_layer_ids(n)
    if n in ids:
        ids.remove(n)  # given explicitly: it is stored last anyway
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise UsageError(f"{flag} {bad}: out of range; auxiliary ids must be in [0, {n - 1}] for a "
                         f"{n}-layer verifier (id {n} = last layer, always stored)")
    if len(set(ids)) != len(ids):
        raise UsageError(f"{flag} {ids}: ids must be distinct")
    if not ids:
        raise UsageError(f"{flag}: give at least one auxiliary layer id")
    return ids + [n]
