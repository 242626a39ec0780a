"""A draft's weights checked before anything loads, from the safetensors headers alone (no torch): each header read
as the format defines it (an 8-byte little-endian length, that much JSON, then the data, the tensors' [begin, end)
offsets tiling it exactly), every tensor speculators' Eagle3DraftModel holds in the shape its config.json gives, no
decoder layer beyond the config's count, and the vocabulary map (d2t, t2d: a few MB at most, read whole) inside the
verifier's vocabulary. Random bytes, a file cut short, a header lying about its offsets, a missing or reshaped tensor:
each one line naming the draft, the file and the tensor.
"""
import json
import math
import os
import re
import sys
from array import array

from ..base.errors import UsageError
from ..storage.files import open_input, read_json
from ..verifier import weight_files
from ..verifier.weight_files import ST_BYTES, Bad
from .mla_draft import SERVED

MAX_HEADER = 8 * 2**20  # a draft's header is a few KB a layer; past this it is not a draft's
FLOATS = ("BF16", "F16", "F32")
RERUN = "rerun 04_train.py"


def read_header(path, shown):
    return weight_files.read_header(path, shown, MAX_HEADER, "a draft's")


def read_weights(draft):
    return weight_files.read_weights(draft, MAX_HEADER, "a draft's")


def expected_shapes(cfg, summary, text_cfg):
    """({tensor: shape} the checkpoint must hold, {tensor: shape} it may hold) in speculators' Eagle3DraftModel
    layout; `summary`: draft_check.check_config's."""
    layer, H, V = cfg["transformer_layer_config"], text_cfg["hidden_size"], text_cfg["vocab_size"]
    aux, dv, flags = len(summary["ids"]), summary["draft_vocab"], summary["flags"]
    need = {"fc.weight": [H, aux * H], "lm_head.weight": [dv, H], "norm.weight": [H]}
    optional = {"embed_tokens.weight": [V, H], "d2t": [dv], "t2d": [V]}  # vLLM shares the verifier's embeddings
    if dv != V:  # vLLM maps the draft's tokens through d2t; without it every proposal is another token
        need.update(d2t=[dv], t2d=[V])
    if flags.get("norm_before_fc"):
        need["input_norm.weight"] = [aux * H]
    if flags.get("fc_norm"):
        need.update({f"fc_norm.{i}.weight": [H] for i in range(aux)})
    inter, heads = layer["intermediate_size"], layer["num_attention_heads"]
    for i in range(summary["layers"]):
        p, width = f"layers.{i}.", 2 * H if i == 0 else H  # the first layer reads [embeddings | hidden states]
        need.update({p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H],
                     p + "mlp.gate_proj.weight": [inter, H], p + "mlp.up_proj.weight": [inter, H],
                     p + "mlp.down_proj.weight": [H, inter]})
        for proj in summary.get("biases", {}).get("mlp_bias", ()):  # a bias per output row
            need[f"{p}mlp.{proj}.bias"] = [need[f"{p}mlp.{proj}.weight"][0]]
        if i == 0:
            need[p + "hidden_norm.weight"] = [H]
        a = p + "self_attn."
        if summary["kind"] == "deepseek_v3":  # MLA: transformers' DeepseekV3Attention names (mla_draft.py)
            rope, nope, v, kvr = (layer[k] for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                                     "kv_lora_rank"))
            qr = layer.get("q_lora_rank")
            need.update({a + "kv_a_proj_with_mqa.weight": [kvr + rope, width], a + "kv_a_layernorm.weight": [kvr],
                         a + "kv_b_proj.weight": [heads * (nope + v), kvr], a + "o_proj.weight": [H, heads * v]})
            need.update({a + "q_a_proj.weight": [qr, width], a + "q_a_layernorm.weight": [qr],
                         a + "q_b_proj.weight": [heads * (nope + rope), qr]} if qr else
                        {a + "q_proj.weight": [heads * (nope + rope), width]})
        else:
            hd = layer.get("head_dim") or H // heads
            kv = layer.get("num_key_value_heads") or heads
            need.update({a + "q_proj.weight": [heads * hd, width], a + "k_proj.weight": [kv * hd, width],
                         a + "v_proj.weight": [kv * hd, width], a + "o_proj.weight": [H, heads * hd]})
            if summary["kind"] == "qwen3":
                need.update({a + "q_norm.weight": [hd], a + "k_norm.weight": [hd]})
            for proj in summary.get("biases", {}).get("attention_bias", ()):
                need[f"{a}{proj}.bias"] = [need[f"{a}{proj}.weight"][0]]
    return need, optional


def check_tensors(tensors, cfg, summary, text_cfg, shown="model.safetensors"):
    """Every tensor the config asks for there, in its shape and a dtype vLLM loads; no layer past the config's."""
    layers = summary["layers"]
    found = {int(m.group(1)) for m in (re.match(r"layers\.(\d+)\.", k) for k in tensors) if m}
    missing, extra = sorted(set(range(layers)) - found), sorted(found - set(range(layers)))
    if missing:
        raise Bad(shown, f"no tensors for decoder layer {missing[0]}: the config's num_hidden_layers is {layers}, "
                         f"the weights hold {len(found)} layer(s)")
    if extra:
        key = next(k for k in tensors if k.startswith(f"layers.{extra[0]}."))
        raise Bad(tensors[key][4], f"tensor {key}: a decoder layer past the config's num_hidden_layers ({layers})")
    need, optional = expected_shapes(cfg, summary, text_cfg)
    # vLLM's AutoWeightsLoader refuses a name its model lacks, after the verifier loaded: a bias the config does not
    # ask for included (the config's attention_bias / mlp_bias say which the model has)
    unknown = next((k for k in sorted(tensors) if k not in need and k not in optional), None)
    if unknown is not None:
        why = (" (the config's attention_bias / mlp_bias do not ask for it)" if unknown.endswith(".bias") else
               " (not in the layout of a stage 04 draft; vLLM refuses a name its model lacks)")
        raise Bad(tensors[unknown][4], f"tensor {unknown} is unknown{why}")
    for key, shape in list(need.items()) + [(k, s) for k, s in optional.items() if k in tensors and k not in need]:
        if key not in tensors:
            flag = ("'s " + ("mlp_bias" if ".mlp." in key else "attention_bias")) if key.endswith(".bias") else ""
            raise Bad(shown, f"tensor {key} is missing (the config{flag} asks for it)")
        dtype, got, _, _, where = tensors[key]
        if got != shape:
            raise Bad(where, f"tensor {key} has shape {got}, the config asks for {shape}")
        kinds = ("I64", "I32") if key == "d2t" else ("BOOL",) if key == "t2d" else FLOATS
        if dtype not in kinds:
            raise Bad(where, f"tensor {key} is stored as {dtype}, expected {' or '.join(kinds)}")
    if "d2t" in tensors and "t2d" in tensors:
        check_vocab_map(tensors, text_cfg["vocab_size"])


def _read(tensor):
    dtype, shape, offset, path, _ = tensor
    with open_input(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(math.prod(shape) * ST_BYTES[dtype])


def check_vocab_map(tensors, vocab):
    """d2t (draft id i -> verifier id i + d2t[i]) and t2d (the verifier ids in the draft vocabulary) agree and stay
    inside the verifier's vocabulary (vLLM would index out of range, or propose other tokens than trained)."""
    d2t = array("q" if tensors["d2t"][0] == "I64" else "i", _read(tensors["d2t"]))
    if sys.byteorder != "little":
        d2t.byteswap()
    t2d = _read(tensors["t2d"])
    ids = [i + d for i, d in enumerate(d2t)]
    where = tensors["d2t"][4]
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise Bad(where, f"tensor d2t maps draft id {bad} to verifier id {ids[bad]}, outside the vocabulary of {vocab}")
    if len(set(ids)) != len(ids) or any(t2d[t] != 1 for t in ids) or sum(1 for b in t2d if b) != len(ids):
        raise Bad(where, "tensors d2t and t2d disagree (each draft id maps to a distinct verifier id that t2d marks, "
                         "and t2d marks nothing else)")


def check(draft, cfg, summary, text_cfg):
    """The draft's weights against its config (`summary`: draft_check.check_config's); an MLA draft's vllm/ copy
    too, which is what vLLM loads (mla_draft.write_served)."""
    try:
        tensors = read_weights(draft)
        check_tensors(tensors, cfg, summary, text_cfg)
        if summary["kind"] == "deepseek_v3":
            _check_served(draft, tensors, cfg, summary, text_cfg)
    except (Bad, UsageError) as e:  # UsageError: files.open_input's refusal of a folder, a FIFO, a device
        raise UsageError(f"--draft {draft}: {e}; {RERUN}")
    except OSError as e:
        raise UsageError(f"--draft {draft}: {os.path.relpath(e.filename, draft) if e.filename else 'weights'} "
                         f"unreadable ({e.strerror or e}); {RERUN}")


def _check_served(draft, tensors, cfg, summary, text_cfg):
    served = os.path.join(draft, SERVED)
    try:
        scfg = read_json(os.path.join(served, "config.json"))
    except UsageError as e:
        raise Bad(f"{SERVED}/config.json", f"the copy vLLM loads: {str(e).replace(served + os.sep, '', 1)}")
    same = {"draft_vocab_size": summary["draft_vocab"], "eagle_aux_hidden_state_layer_ids": summary["ids"],
            "hidden_size": text_cfg["hidden_size"], "vocab_size": text_cfg["vocab_size"],
            "num_hidden_layers": summary["layers"], "hidden_act": cfg["transformer_layer_config"]["hidden_act"],
            "quantization_config": None}
    for key, want in same.items():
        got = scfg.get(key) if isinstance(scfg, dict) else None
        if got != want:
            raise Bad(f"{SERVED}/config.json", f"{key} {json.dumps(got)[:60]}, the checkpoint's config.json says "
                                               f"{json.dumps(want)[:60]}")
    weights, shown = os.path.join(served, "model.safetensors"), f"{SERVED}/model.safetensors"
    if not os.path.lexists(weights):
        raise Bad(shown, "missing (the copy vLLM loads)")
    if not os.path.samefile(weights, tensors["fc.weight"][3]):  # stage 04 hard-links it: then it is checked already
        check_tensors(read_header(weights, shown), cfg, summary, text_cfg, shown)
