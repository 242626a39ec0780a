"""The verifier as the pipeline sees it before loading any weights: its config, fingerprint and layer ids.

Layer-id convention (vLLM's and speculators'): with n = num_hidden_layers, id k (0 <= k < n) is the input
of decoder layer k = the output of layer k-1 (id 0 = the embedding output); id n is the output of the
last decoder layer BEFORE the final norm. The default auxiliary ids are [2, n//2, n-3]; id n is always
stored after them.
"""
import glob
import hashlib
import importlib.util
import json
import logging
import os
import re

from ..adapters import _dist
from ..base.errors import UsageError
from ..storage import files
from ..storage.files import read_json, open_input
from .hub import HUB_ID, hub_file
from .quantization import tensor_table

LAYER_ID_CONVENTION = ("id k < n = input of decoder layer k (0 = embedding output); id n = output of the "
                       "last decoder layer before the final norm")
TEMPLATE_BYTES = 64 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model",
                   "vocab.json", "merges.txt", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json")


def check_positions(flag, positions, fp, what=None):
    """Refuse `positions` beyond what the verifier handles (its max_position_embeddings), naming `flag`."""
    most = fp.get("max_position_embeddings")
    if isinstance(most, int) and positions > most:
        raise UsageError(f"{flag}: {what or f'{positions:,} positions'} reach past the {most:,} positions the verifier "
                         f"handles (its max_position_embeddings)")


def model_files(model_path):
    """(config dict, folder holding the tokenizer files) for a local folder or a hub id."""
    if os.path.isdir(model_path):
        cfg_path = os.path.join(model_path, "config.json")
        if not os.path.isfile(cfg_path):
            raise UsageError(f"--model-path {model_path}: no config.json in this folder")
        folder = model_path
    elif HUB_ID.match(model_path) and not os.path.exists(model_path):
        cfg_path = hub_file(model_path, "config.json")
        folder = os.path.dirname(cfg_path)
    else:
        raise UsageError(f"--model-path {model_path}: folder not found (and not a hub id like org/name)")
    cfg = read_json(cfg_path, once=True)
    if not isinstance(cfg, dict):
        raise UsageError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg, folder


def text_config(cfg):
    """The language model's config: multimodal wrappers (Kimi-K2.5, Llava, ...) nest it in text_config."""
    tc = cfg.get("text_config") or cfg.get("language_config")
    return tc if isinstance(tc, dict) else cfg


def open_verifier(model_path, trust_remote_code):
    """What every stage reads of its verifier before anything loads: (fingerprint, the language model's config);
    a verifier that ships code transformers cannot replace needs --trust-remote-code (refused here otherwise)."""
    fp = fingerprint(model_path)
    check_remote_code(model_path, trust_remote_code)
    check_generation_config(model_path)
    return fp, text_config(model_files(model_path)[0])


def check_generation_config(model_path):
    """A local verifier's generation_config.json, where it has one, is a JSON object: it names the tokens the
    verifier's answers end at (what stage 01 trains through and --regenerate stops at), and vLLM and transformers
    read it; one that does not parse was ignored in silence."""
    path = os.path.join(model_path, "generation_config.json")
    if os.path.isdir(model_path) and os.path.lexists(path):
        cfg = read_json(path)
        if not isinstance(cfg, dict):
            raise UsageError(f"{path}: expected a JSON object, got {type(cfg).__name__}")


def _json_or_refuse(path, data):
    try:
        json.loads(data)
    except (ValueError, RecursionError) as e:
        raise UsageError(f"{path}: not valid JSON ({' '.join(str(e).split())[:160]}); the tokenizer cannot load")


def fingerprint(model_path):
    """What identifies a verifier for the pipeline: shapes, vocab and a hash of the tokenizer files."""
    cfg, folder = model_files(model_path)
    tc = text_config(cfg)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if not tc.get(k)]
    if missing:
        raise UsageError(f"--model-path {model_path}: config.json lacks {', '.join(missing)}")
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                "max_position_embeddings"):  # counts every stage computes with: a float or a string is a hand edit
        value = tc.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise UsageError(f"--model-path {model_path}: config.json's '{key}' is {value!r}, expected a positive "
                             f"whole number")
    if not isinstance(cfg.get("architectures") or [], list):
        raise UsageError(f"--model-path {model_path}: config.json's 'architectures' is {cfg['architectures']!r}, "
                         f"expected a list of class names")
    h = hashlib.sha256()
    found = []
    for name in TOKENIZER_FILES:
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            found.append(name)
            h.update(name.encode())
            with open_input(p, "rb") as f:
                data = f.read()
            h.update(hashlib.sha256(data).digest())
            if name.endswith(".json"):  # unreadable, it would be named by its hash as another verifier's
                _json_or_refuse(p, data)
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
        "weights_sha256": weights_sample(folder) if os.path.isdir(model_path) else None,
    }


def weights_sample(folder, samples=64, chunk=16384):
    """A hash of the weights that reads 1 MiB a file, not all of them (547 GB for Kimi): each weight file's name and
    size and `samples` chunks spread evenly over it. A fine-tune of the same shapes changes nearly every chunk; the
    same weights copied elsewhere hash the same. None when the folder holds no weight file."""
    h, found = hashlib.sha256(), False
    for name in sorted(os.listdir(folder)):
        if not name.endswith((".safetensors", ".bin", ".pt", ".gguf")):
            continue
        with open_input(os.path.join(folder, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(f"{name}\0{size}\0".encode())
            for i in range(samples):
                f.seek(size * i // samples)
                h.update(f.read(chunk))
        found = True
    return h.hexdigest()[:16] if found else None


def _transformers_knows():
    """(model types, tokenizer class names without 'Fast') of the installed transformers, read from its source:
    importing transformers imports torch (seconds), and this check runs before anything heavy. None if not found."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = spec.submodule_search_locations[0]

    def read(path):
        try:
            with open_input(path, encoding="utf-8") as f:
                return f.read()
        except OSError:
            return ""
    auto = os.path.join(root, "models", "auto")
    # ("llama", "LlamaConfig") and "mlcd": "MLCDVisionConfig"; auto_mappings.py in 5.x, configuration_auto.py in 4.x
    mappings = read(os.path.join(auto, "auto_mappings.py")) + read(os.path.join(auto, "configuration_auto.py"))
    types = set(re.findall(r'"([\w-]+)"\s*[,:]\s*"\w+Config"', mappings))
    classes = set(re.findall(r'"(\w+(?:Tokenizer|Backend)(?:Fast)?)"',
                             read(os.path.join(auto, "tokenization_auto.py"))))
    for path in glob.glob(os.path.join(root, "models", "*", "tokenization_*.py")) + \
            glob.glob(os.path.join(root, "tokenization_*.py")):
        # classes and aliases (PreTrainedTokenizerFast = TokenizersBackend)
        classes.update(a or b for a, b in re.findall(r"^(?:class (\w+)\(|(\w+) = [A-Z]\w*\s*$)", read(path), re.M))
    if not types:
        return None
    return types, {c.removesuffix("Fast") for c in classes}


def check_remote_code(model_path, trust_remote_code):
    """Refuse, without --trust-remote-code, a verifier that ships its own code transformers cannot replace: a
    config.json `auto_map` with a model type transformers does not know, or a tokenizer_config.json `auto_map`
    naming an AutoTokenizer whose tokenizer_class transformers does not know (a generic tokenizer in its place
    could tokenize differently). transformers itself never runs that code without the flag; this makes the
    refusal one line, in seconds, before anything loads. Reads JSON only: no torch, no transformers import."""
    if trust_remote_code:
        return
    cfg, folder = model_files(model_path)
    known = _transformers_knows()
    if known is None:  # cannot tell: transformers' own refusal (masks.load_tokenizer) still applies
        return
    types, classes = known
    hint = "rerun with --trust-remote-code if you trust that code"
    model_type = cfg.get("model_type")
    if cfg.get("auto_map") and (not isinstance(model_type, str) or model_type not in types):
        raise UsageError(f"--model-path {model_path}: the model ships its own code (config.json auto_map, model_type "
                         f"{model_type!r} unknown to the installed transformers); {hint}")
    if isinstance(model_type, str) and model_type not in types:  # neither transformers nor vLLM (whose config is
        # transformers') can build it: every backend would fail as it loads, after the folder was taken
        dist = _dist("transformers")
        raise UsageError(f"--model-path {model_path}: config.json's model_type {model_type!r} is no family the "
                         f"installed transformers{f' ({dist.version})' if dist else ''} knows, and the model ships no "
                         f"code of its own (auto_map): nothing here can load it; a typo in config.json, or a newer "
                         f"transformers")
    if os.path.isdir(model_path):
        tok_path = os.path.join(folder, "tokenizer_config.json")
        tok_path = tok_path if os.path.isfile(tok_path) else None
    else:
        tok_path = hub_file(model_path, "tokenizer_config.json", optional=True)
    tok_cfg = read_json(tok_path) if tok_path else {}
    auto_map = tok_cfg.get("auto_map") if isinstance(tok_cfg, dict) else None
    # the legacy form is a bare [slow, fast] list
    ships = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map
    tok_class = tok_cfg.get("tokenizer_class") if isinstance(tok_cfg, dict) else None
    if ships and (not isinstance(tok_class, str) or tok_class.removesuffix("Fast") not in classes):
        raise UsageError(f"--model-path {model_path}: the tokenizer ships its own code (tokenizer_config.json "
                         f"auto_map, tokenizer_class {tok_class!r} unknown to the installed transformers); {hint}")


IDENTITY = files.VERIFIER_IDENTITY


def same_verifier(a, b):
    """The first identity field on which two fingerprints differ, or None. The weights' hash is compared where both
    have one (outputs written before it was recorded, and hub ids, have none)."""
    for k in IDENTITY:
        if a.get(k) != b.get(k):
            return k
    if a.get("weights_sha256") and b.get("weights_sha256") and a["weights_sha256"] != b["weights_sha256"]:
        return "weights_sha256"
    return None


def default_layer_ids(n):
    return [2, n // 2, n - 3]


def resolve_layer_ids(ids, n, flag="--layer-ids"):
    """Validated auxiliary ids, then id n (the last layer) appended: the order stored in every file."""
    if not ids and not 0 < 2 < n // 2 < n - 3:  # the default [2, n//2, n-3] fits from 7 layers on
        fit = sorted({max(0, min(n - 1, x)) for x in (1, n // 2, n - 1)})
        raise UsageError(f"{flag}: the default auxiliary ids [2, n//2, n-3] = {default_layer_ids(n)} do not fit a "
                         f"{n}-layer verifier (distinct, ascending, below {n}); give {flag}, e.g. "
                         f"{','.join(map(str, fit))}")
    ids = list(ids) if ids else default_layer_ids(n)
    if len(set(ids)) != len(ids):
        raise UsageError(f"{flag} {ids}: ids must be distinct")
    if n in ids:
        if ids[-1] != n:  # the last layer is stored last: given elsewhere, the order asked is not the order kept
            raise UsageError(f"{flag} {ids}: id {n} (the last layer, always stored) goes last, if given")
        ids.remove(n)  # given explicitly: it is stored last anyway
        if ids and len(ids) < len(default_layer_ids(n)):  # `2,15,30` on 30 layers: likely meant as a third aux layer
            logging.getLogger("eagle3").warning(
                f"{flag} {','.join(map(str, ids + [n]))}: id {n} is the {n}-layer verifier's last layer, stored in "
                f"every file anyway; the draft gets {len(ids)} auxiliary layer(s), {ids} (EAGLE-3 takes 3, e.g. "
                f"{','.join(map(str, default_layer_ids(n)))})")
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise UsageError(f"{flag} {bad}: out of range; auxiliary ids must be in [0, {n - 1}] for a "
                         f"{n}-layer verifier (id {n} = last layer, always stored)")
    if ids != sorted(ids):  # vLLM hands a served draft its auxiliary states in layer order, whatever order it trained on
        raise UsageError(f"{flag} {ids}: give the ids in ascending order ({','.join(map(str, sorted(ids)))}); vLLM "
                         f"serves a draft its auxiliary states in layer order")
    if not ids:
        raise UsageError(f"{flag}: give at least one auxiliary layer id")
    return ids + [n]


FLOAT_DTYPES = ("BF16", "F16", "F32")


def _tensor_dtypes(model_path):
    """{tensor name: safetensors dtype} of a local checkpoint, from its index and shard headers (no torch)."""
    return {k: v[0] for k, v in tensor_table(model_path).items()}


def _find(dtypes, suffix):
    """The tensor speculators would take for `suffix`: an exact name, else the shortest name ending with it."""
    if suffix in dtypes:
        return suffix
    hits = sorted((k for k in dtypes if k.endswith("." + suffix)), key=len)
    return hits[0] if hits else None


def check_draft_sources(model_path, tied):
    """The draft's embedding and lm_head are copied from the verifier's `embed_tokens.weight` and `lm_head.weight` as
    stored, without dequantizing. A quantized one (INT4 compressed-tensors keeps `*.weight_packed`; fp8 or int8 under
    `*.weight`) would be copied as raw integers, or a missing lm_head silently replaced by the embedding: refuse that.
    Hub ids are not checked here (no local files)."""
    if not os.path.isdir(model_path):
        return
    dtypes = _tensor_dtypes(model_path)
    for suffix in ("embed_tokens.weight",) + (() if tied else ("lm_head.weight",)):
        name = _find(dtypes, suffix)
        packed = _find(dtypes, suffix.replace(".weight", ".weight_packed"))
        if name is None and packed:
            raise UsageError(f"--model-path {model_path}: the verifier's {packed} is quantized (packed integers); the "
                             f"draft's {suffix.split('.')[0]} needs its unquantized weights: keep {suffix} in bf16 "
                             f"when quantizing (compressed-tensors' usual ignore list does)")
        if name is None:
            raise UsageError(f"--model-path {model_path}: no {suffix} among the checkpoint's tensors; the draft copies "
                             f"it from the verifier")
        if dtypes[name] not in FLOAT_DTYPES:
            raise UsageError(f"--model-path {model_path}: the verifier's {name} is stored as {dtypes[name]} "
                             f"(quantized); the draft needs it unquantized (bf16, fp16 or fp32)")


def check_chat_files(model_path):
    """A local verifier folder has tokenizer files and a chat template that parses, looked at before transformers
    loads (its own messages for a missing one are cut mid-sentence, and a template that does not parse failed at the
    first conversation, after the imports). Hub ids: the loader's."""
    if not os.path.isdir(model_path):
        return
    present = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(model_path, n))]
    if not present:
        raise UsageError(f"--model-path {model_path}: no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...)")
    templates = []  # (where, text)
    jinja = os.path.join(model_path, "chat_template.jinja")
    if os.path.isfile(jinja):
        try:
            with open_input(jinja, encoding="utf-8") as f:
                size = os.fstat(f.fileno()).st_size
                if size > TEMPLATE_BYTES:  # read whole below (a cut template does not parse): bounded here
                    raise UsageError(f"{jinja}: {size / 2**20:,.0f} MiB, past the {TEMPLATE_BYTES >> 20} MiB a chat "
                                     f"template may have (templates are kilobytes): is it the right file?")
                templates.append((jinja, f.read()))
        except (OSError, ValueError) as e:
            raise UsageError(f"{jinja}: unreadable ({getattr(e, 'strerror', None) or e})")
    for name in ("chat_template.json", "tokenizer_config.json"):
        if name in present and not templates:
            cfg = read_json(os.path.join(model_path, name))
            templates += _named_templates(os.path.join(model_path, name), cfg.get("chat_template")
                                          if isinstance(cfg, dict) else None)
    if not templates:
        raise UsageError(f"--model-path {model_path}: no chat template (chat_template.jinja, or 'chat_template' in "
                         f"tokenizer_config.json); stages 01 and 05 render conversations through it")
    for where, text in templates:
        _parse_template(where, text)


def _named_templates(where, value):
    """A config's chat_template: one string, or a list of {name, template} (transformers takes both)."""
    if isinstance(value, str) and value:
        return [(where, value)]
    if isinstance(value, list):
        return [(f"{where} ('{t.get('name')}')", t.get("template")) for t in value
                if isinstance(t, dict) and isinstance(t.get("template"), str)]
    return []


def _parse_template(where, text):
    """Parse (not render) a chat template as transformers' environment does: loop controls, and its
    {% generation %} block for assistant masks."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(extensions=[Generation, "jinja2.ext.loopcontrols"])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise UsageError(f"{where}: the chat template does not parse (line {e.lineno}: {e.message}); stages 01 and "
                         f"05 render conversations through it")


def check_weights(model_path):
    """A local verifier folder holds weights the loaders take, whole: safetensors (headers read, each file as long as
    its tensors need) or PyTorch .bin/.pt files; a GGUF file alone is named (it needs converting). Hub ids: not here."""
    if not os.path.isdir(model_path):
        return
    names = os.listdir(model_path)
    if any(n.endswith(".safetensors") for n in names) or os.path.isfile(
            os.path.join(model_path, "model.safetensors.index.json")):
        tensor_table(model_path)
    elif not any(n.endswith((".bin", ".pt")) for n in names):
        gguf = sorted(n for n in names if n.endswith(".gguf"))
        raise UsageError(f"--model-path {model_path}: " + (
            f"holds only a GGUF file ({gguf[0]}); transformers and vLLM load safetensors here: convert it first"
            if gguf else "no weight files (*.safetensors, *.bin)"))


def weights_bytes(model_path):
    """The checkpoint's bytes: its index's total_size (what a quantized checkpoint really holds: INT4 experts count
    half a byte per weight), else the size of its weight files."""
    if not os.path.isdir(model_path):
        return None  # a hub id: unknown until downloaded
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        index = read_json(index)
        meta = index.get("metadata") if isinstance(index, dict) else None
        total = meta.get("total_size") if isinstance(meta, dict) else None  # else the files' sizes: the weights
        # check (weight_files.read_index) names what is wrong with the index
        if isinstance(total, int) and total > 0:
            return total
    files = glob.glob(os.path.join(model_path, "*.safetensors")) or glob.glob(os.path.join(model_path, "*.bin"))
    return sum(os.path.getsize(f) for f in files)
