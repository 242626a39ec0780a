"""The verifier's weights against its config, before any engine or weight loads.

The model's own definition says what the checkpoint must hold: transformers builds the language model from its config
on the meta device (no memory, no weight read; a tenth of a second for a 61-layer DeepSeek-V3), and the tensor names
and shapes it would save (`revert_weight_conversion`: routed experts one tensor each, as checkpoints keep them) are
matched against the safetensors headers (weight_files.py: every header tiles its file, the index names only files
that are there). Every expected tensor must be there, in its shape, in a dtype the loaders take; nothing else may
be, except what the model itself declares:
- tied weights (`all_tied_weights_keys`: the head shares the embeddings) may be absent, or present in their shape;
- checkpoint tensors the definition skips (`_keys_to_ignore_on_load_unexpected`: DeepSeek-V3's multi-token
  prediction layer 61);
- a quantized Linear's stored form: compressed-tensors' pack-quantized `weight_packed` [out, in * bits / 32] with
  `weight_scale` and `weight_shape` (quantization.py checks the scales), or another method's extra tensors beside
  (or in place of) `weight` (an fp8 `weight_scale_inv`, say);
- a multimodal wrapper's own tensors (the vision tower) outside its language model, whose prefix is read from where
  the checkpoint keeps the embeddings (`language_model.model.`, `model.language_model.`).
Why: transformers initialises a missing weight at random and says so only in its log (stage 02 then extracts a random
network's states, exit 0); vLLM refuses it only once its engine has started (over 20 minutes for Kimi-K2.5).
A verifier whose family the installed transformers does not know is matched structurally only (the headers); the
plan says so.

The definition is kept, as JSON, in `<XDG_CACHE_HOME or ~/.cache>/eagle3pipe/definitions/`, by the text config and
the transformers version (a folder trusted as the compile cache is: compile_cache.distrust): a rerun, a later stage
or another replica checks the same verifier in a second, without importing torch. A cache file that does not read
as one is ignored and made again.
"""
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re

from . import quantization
from .. import adapters
from ..base.compile_cache import distrust, setting_kept
from ..base.errors import UsageError
from ..storage.files import read_json
from .verifier import _transformers_knows, text_config
from .weight_files import ST_BYTES, INDEX, Bad, read_index

log = logging.getLogger("eagle3")

FLOATS = ("BF16", "F16", "F32", "F64")
F8 = ("F8_E4M3", "F8_E5M2")
PACKED_METHODS = ("gptq", "awq")  # each Linear stored as <module>.qweight (+ qzeros, scales)
PACKED = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")  # compressed-tensors' packed Linear
SHOW = 3  # names a refusal lists


@dataclasses.dataclass(frozen=True)
class Definition:
    """What the model's definition holds, as a checkpoint stores it."""
    arch: str            # the class transformers built (LlamaForCausalLM, ...)
    tensors: dict        # {name as saved: (shape, floating)}
    tied: frozenset      # names the model ties to another (may be absent from the checkpoint)
    skip: tuple          # regexes of checkpoint names the model ignores on load
    spare: tuple         # regexes of names the model computes itself when a checkpoint lacks them
    base: str            # the base model's prefix ("model")
    embedding: str       # the input embeddings' name as saved ("model.embed_tokens.weight")


CACHE_VERSION = 1


def _cache_file(text_cfg):
    """Where the definition of `text_cfg` under the installed transformers is kept, or None (no trusted folder)."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "eagle3pipe", "definitions")
    if distrust(folder):
        return None
    key = json.dumps({"text_config": text_cfg, "transformers": version, "v": CACHE_VERSION}, sort_keys=True,
                     default=str)
    return os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _cached(path):
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        d = Definition(raw["arch"], {k: (list(v[0]), bool(v[1])) for k, v in raw["tensors"].items()},
                       frozenset(raw["tied"]), tuple(raw["skip"]), tuple(raw["spare"]), raw["base"], raw["embedding"])
        if not all(isinstance(x, str) for x in (d.arch, d.base, d.embedding, *d.tied, *d.skip, *d.spare)) or not all(
                all(isinstance(n, int) for n in v[0]) for v in d.tensors.values()):
            raise ValueError
        return d
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None  # missing, or not one: made again


def _keep(path, d):
    """Write the definition beside the others: a fresh private file renamed into place (the folder is this user's
    alone, compile_cache.distrust); a failure costs only the next run's second."""
    raw = {"arch": d.arch, "tensors": {k: [v[0], v[1]] for k, v in d.tensors.items()}, "tied": sorted(d.tied),
           "skip": list(d.skip), "spare": list(d.spare), "base": d.base, "embedding": d.embedding}
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(raw, f)
        os.replace(tmp, path)
    except OSError:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def definition(cfg, text_cfg, model_path, trust_remote_code):
    """-> Definition from transformers' own model class (kept: see the module's docstring), or None where it does
    not know the family. Imports torch and transformers (seconds) when not kept; builds nothing real."""
    known = _known(text_cfg.get("model_type"))
    cache = _cache_file(text_cfg) if known else None
    d = _cached(cache) if cache else None
    if d is None and (known or trust_remote_code):
        d = _build(cfg, text_cfg, model_path, trust_remote_code)
        if cache and d is not None:
            _keep(cache, d)
    return d


def _known(model_type):
    """Whether the installed transformers has a config for `model_type`, read without importing it."""
    knows = _transformers_knows()
    return knows is not None and isinstance(model_type, str) and model_type in knows[0]


def _build(cfg, text_cfg, model_path, trust_remote_code):
    """The Definition, from transformers' class for the family built on the meta device."""
    adapters.check_private("transformers")
    with setting_kept():  # stage 04 chooses the compile cache later (compile_cache.py)
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.core_model_loading import revert_weight_conversion
    transformers.utils.logging.set_verbosity_error()  # its notes on unused config keys are not the operator's
    model_type = text_cfg.get("model_type")
    known = model_type in transformers.CONFIG_MAPPING
    try:
        if known:
            config = AutoConfig.for_model(model_type, **{k: v for k, v in text_cfg.items() if k != "model_type"})
        elif trust_remote_code and text_cfg is cfg:
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=True)
        else:
            return None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a config its own family's code refuses, however it says so (an assert on
        # pad_token_id, huggingface_hub's StrictDataclassClassValidationError for heads that do not divide the width)
        raise UsageError(f"--model-path {model_path}: transformers {transformers.__version__} cannot build the "
                         f"{model_type} model its config describes ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]}); the config does not match its family")
    state = model.state_dict()  # parameters and persistent buffers: what a checkpoint holds
    tied = frozenset(getattr(model, "all_tied_weights_keys", None) or {})
    emb = model.get_input_embeddings()
    embedding = next((n for n, p in model.named_parameters(remove_duplicate=False) if p is emb.weight), "")
    saved = revert_weight_conversion(model, {k: v for k, v in state.items() if k not in tied})
    tensors = {k: (list(v.shape), v.dtype.is_floating_point) for k, v in saved.items()}
    tensors.update({k: (list(state[k].shape), True) for k in tied if k in state})
    skip = tuple(model._keys_to_ignore_on_load_unexpected or ())
    spare = tuple(model._keys_to_ignore_on_load_missing or ())
    return Definition(type(model).__name__, tensors, tied, skip, spare, model.base_model_prefix, embedding)


def _root(tensors, d):
    """Where the checkpoint keeps the base model: the prefix before its embeddings' name (the definition's own
    prefix, else a multimodal wrapper's), and the candidate prefixes of the other tensors (the head)."""
    own = d.base + "."
    tail = d.embedding[len(own):] if d.embedding.startswith(own) else d.embedding
    shape = d.tensors.get(d.embedding, (None,))[0]
    found = sorted((k[:-len(tail)] for k in tensors if k == tail or k.endswith("." + tail)),
                   key=lambda r: (r != own, tensors[r + tail][1] != shape, len(r)))
    root = found[0] if found else own
    heads = [root[:-len(own)]] if root.endswith(own) else []
    return root, heads + [h for h in ("",) if h not in heads]


def stored_names(tensors, d):
    """name -> the checkpoint's name of the same tensor, for every name the definition `d` saves: under the root the
    checkpoint keeps the base model in, the rest (the head) under the first prefix that holds it."""
    root, heads = _root(tensors, d)
    own = d.base + "."

    def stored(name):
        if name.startswith(own):
            return root + name[len(own):]
        return next((h + name for h in heads if h + name in tensors), heads[0] + name)
    return stored


def _where(name, wmap, tensors):
    if wmap:
        return wmap.get(name) or f"any of the {len(set(wmap.values())):,} files its index names"
    files = sorted({v[4] for v in tensors.values()})
    return files[0] if len(files) == 1 else f"any of its {len(files):,} files"


def _packed_shape(shape, bits):
    out, cols = shape
    return [out, -(-cols * bits // 32)]


def check(model_path, cfg, text_cfg, trust_remote_code, tensors, wmap, quantization=None, quant_cfg=None):
    """Refuse, in one line naming the tensor and its file, a checkpoint that is not the model its config describes.
    `tensors`: weight_files.read_weights'; `wmap`: its index's table ({} without one); `quantization`:
    quantization.read's; `quant_cfg`: the config's quantization_config. -> the plan's line."""
    d = definition(cfg, text_cfg, model_path, trust_remote_code)
    where = f"--model-path {model_path}"
    if d is None:
        return (f"{len(tensors):,} tensors read; not matched against a model definition (transformers does not know "
                f"model_type {text_cfg.get('model_type')!r})")
    stored = stored_names(tensors, d)
    root, own = _root(tensors, d)[0], d.base + "."
    bits = quantization.bits if quantization is not None and quantization.fmt == "pack-quantized" else 0
    quantized = quant_cfg is not None
    method = quant_cfg.get("quant_method") if isinstance(quant_cfg, dict) else None
    if method in PACKED_METHODS and not any(k.endswith(".qweight") for k in tensors):
        raise UsageError(f"{where}: config.json quantizes with {method}, and no tensor is stored in its form (no "
                         f"<module>.qweight): the weights are stored unquantized; drop its quantization_config, or "
                         f"give its quantized weights")
    claimed, missing, modules = set(), [], set()
    heads = _root(tensors, d)[1]
    for name, (shape, floating) in d.tensors.items():
        key = stored(name)
        module = key[:-len(".weight")] if key.endswith(".weight") else None
        if key in tensors:
            claimed.add(key)
            dtype, got = tensors[key][0], list(tensors[key][1])
            if got != shape:
                turned = " (transposed)" if len(shape) == 2 and got == shape[::-1] and shape[0] != shape[1] else ""
                raise UsageError(f"{where}: {tensors[key][4]}: tensor {key} is {got}, the config makes it "
                                 f"{shape}{turned}: another model's weights, or a config that does not match them")
            if floating and dtype not in FLOATS and method == "fp8":  # its weights are F8, each with its scale
                scale = next((s for s in (".weight_scale_inv", ".weight_scale") if module and module + s in tensors), None)
                if dtype not in F8 or scale is None:
                    raise UsageError(f"{where}: {tensors[key][4]}: tensor {key} is stored as {dtype}"
                                     + (" with no scale beside it" if dtype in F8 else "") + f"; the config's fp8 "
                                     f"quantization stores a weight as F8_E4M3 with {module}.weight_scale_inv")
            if floating and dtype not in FLOATS and (bits or not quantized):  # fp8's weights are F8: its own form
                raise UsageError(f"{where}: {tensors[key][4]}: tensor {key} is stored as {dtype}; the model computes "
                                 f"it in floating point, and " + (f"int{bits} pack-quantized weights are stored as "
                                                                  f"{module}.weight_packed" if bits else
                                                                  "the config quantizes nothing"))
            if module is not None and quantized:
                modules.add(module)
            continue
        if module is not None and bits and module + ".weight_packed" in tensors:
            packed = tensors[module + ".weight_packed"]
            if len(shape) != 2 or list(packed[1]) != _packed_shape(shape, bits):
                raise UsageError(f"{where}: {packed[4]}: tensor {module}.weight_packed is {list(packed[1])}, a "
                                 f"{shape} weight in int{bits} packs to {_packed_shape(shape, bits)}: another "
                                 f"model's weights, or a config that does not match them")
            if module + ".weight_shape" not in tensors:
                raise UsageError(f"{where}: {packed[4]}: {module}.weight_packed has no {module}.weight_shape")
            modules.add(module)
            claimed.update(f"{module}.{p}" for p in PACKED if f"{module}.{p}" in tensors)
            continue
        if module is not None and bits and module + ".weight_scale" in tensors:
            key, shape = module + ".weight_packed", _packed_shape(shape, bits) if len(shape) == 2 else shape
        elif module is not None and quantized and not bits and any(k.startswith(module + ".") for k in tensors):
            modules.add(module)  # another method's stored form: its tensors are claimed below
            continue
        if name not in d.tied and not any(re.search(p, name) for p in d.spare):
            missing.append((key, shape))
    if missing:
        key, shape = missing[0]
        layers = sorted({int(m.group(1)) for m in (re.search(r"\blayers\.(\d+)\.", k) for k, _ in missing) if m})
        span = f"; layers {layers[0]}-{layers[-1]} lack tensors" if len(layers) > 1 else \
            (f"; layer {layers[0]} lacks tensors" if layers else "")
        raise UsageError(f"{where}: no tensor {key} {shape} in {_where(key, wmap, tensors)} ({len(missing):,} of "
                         f"the {len(d.tensors):,} tensors a {d.arch} with this config holds are missing{span}): the "
                         f"checkpoint is incomplete (a shard missing?) or another model's; no backend may fill a "
                         f"weight at random")
    if modules:  # a quantized module's own tensors beside its weight
        claimed.update(k for k in tensors if k.rsplit(".", 1)[0] in modules)
    extra = sorted(k for k in tensors if k not in claimed and (k.startswith(root) or text_cfg is cfg or
                                                               any(k == h + "lm_head.weight" for h in heads))
                   and not any(re.search(p, own + k[len(root):] if k.startswith(root) else k) for p in d.skip))
    if extra:
        more = f"{len(extra):,} such tensors, also {', '.join(extra[1:SHOW])}" if len(extra) > 1 else "the only one"
        raise UsageError(f"{where}: {tensors[extra[0]][4]}: tensor {extra[0]} is not part of a {d.arch} with this "
                         f"config ({more}): another model's weights, or a config that does not match them")
    nbytes = sum(ST_BYTES[tensors[k][0]] * math.prod(tensors[k][1]) for k in claimed)
    return (f"{len(claimed):,} tensors ({nbytes / 2**30:.2f} GiB) match the {d.arch} its config defines"
            + (f" (under {root!r})" if root != own else ""))


@functools.lru_cache(maxsize=None)  # stage 02's launcher checks each replica's verifier: once a process
def verify(model_path, trust_remote_code):
    """The whole check for a local verifier folder (a hub id's files are not here: its loader checks them as they
    come) -> the plan's line, or None. Headers first (no torch), then the definition."""
    if not os.path.isdir(model_path):
        return None
    names = os.listdir(model_path)
    if not any(n.endswith(".safetensors") for n in names) and INDEX not in names:
        return "PyTorch .bin weights: their names are read only as they load (pickle), not checked here"
    cfg = read_json(os.path.join(model_path, "config.json"), once=True)
    table = quantization.tensor_table(model_path)
    try:
        wmap = read_index(model_path) if INDEX in names else {}
    except Bad as e:
        raise UsageError(f"--model-path {model_path}: {e}")
    tensors = {k: (v[0], v[1], None, None, v[2]) for k, v in table.items()}
    quant = quantization.read(model_path, cfg, table)
    return check(model_path, cfg, text_config(cfg), trust_remote_code, tensors, wmap, quant,
                 quantization.config_of(cfg))


def say(model_path, trust_remote_code, rank=0):
    """Log what verify() found (cached from the check itself) once the stage's folder is taken: said earlier, the line
    would stand beside a later refusal's."""
    line = verify(model_path, trust_remote_code) if rank == 0 else None
    if line:
        log.info(f"verifier weights: {line}")


def check_loaded(info, model_path):
    """After transformers loaded the verifier (`info`: from_pretrained's output_loading_info): a weight it initialised
    at random (missing) or reshaped (mismatched) stops the stage in one line. verify() refuses these before the load;
    this holds for a hub id's files, and for whatever the headers cannot show."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(k[0] if isinstance(k, (tuple, list)) else k for k in info.get("mismatched_keys") or ())
    if missing or mismatched:
        name, why = (missing[0], "missing from the checkpoint") if missing else (mismatched[0], "of another shape in "
                                                                                               "the checkpoint")
        raise UsageError(f"--model-path {model_path}: transformers loaded the verifier with {name} {why} "
                         f"({len(missing):,} missing, {len(mismatched):,} misshapen), so initialised at random; "
                         f"refused: the checkpoint is not the model its config describes")
