"""Command-line plumbing shared by the numbered scripts.

- `Parser`: argparse with no abbreviations (so `--batch` never silently means `--batch-size`), one-line
  errors (`error: ...`, exit 2) and a "did you mean" for misspelled flags.
- `parse_args`: `--config configs/X.yaml` gives defaults, explicit flags win. A config file is one flat
  mapping shared by every stage, plus optional per-stage sections (`prepare:`, `extract:`, `vocab:`,
  `train:`, `evaluate:`) that override it. Unknown keys and wrong types are refused.
- `UsageError` + `run`: any validation failure anywhere becomes one line on stderr and exit code 2.
Nothing here imports torch.
"""
import argparse
import difflib
import logging
import os
import re
import sys

SECTIONS = ("prepare", "extract", "vocab", "train", "evaluate")

# Every key a config file may hold, with its type. One place, so a typo in a config is an error, not a
# silently ignored default. tests/test_configs.py checks this against every script's flags.
CONFIG_KEYS = {
    "model_path": str, "dataset": str, "split": str, "prepared_data": str, "hidden_states": str,
    "vocab_mapping": str, "checkpoint_dir": str, "eval_dir": str,
    "max_seq_len": int, "num_samples": int, "seed": int, "trust_remote_code": bool, "regenerate": bool,
    "regen_temperature": float, "regen_max_tokens": int, "regen_batch_size": int, "regen_tp_size": int,
    "tp_size": int, "batch_size": int, "gpu_memory_utilization": float, "layer_ids": list,
    "backend": str, "max_tokens_per_batch": int, "storage_dtype": str, "writer_threads": int,
    "draft_vocab_size": int,
    "epochs": int, "lr": float, "max_steps": int, "total_seq_len": int, "num_layers": int,
    "ttt_steps": int, "device": str, "checkpoint_freq": float, "log_every": int, "warmup_steps": int,
    "val_ratio": float, "num_workers": int, "fsdp": bool, "draft": str,
    "loss_implementation": str,
    "prompts": str, "num_prompts": int, "num_speculative_tokens": int, "max_new_tokens": int,
    "batch_sizes": list,
}


class UsageError(Exception):
    """A problem the operator fixes by changing a flag, a file or a record. Printed as one line, exit 2."""


def run(main):
    """Run a script's main(); a UsageError becomes `error: ...` on stderr and exit code 2."""
    try:
        code = main()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(code or 0)


# Flag names operators bring from other tools (speculators, SpecForge, vLLM) and from older versions.
KNOWN_MISTAKES = {
    "--data-path": "--prepared-data", "--data-dir": "--prepared-data", "--data": "--prepared-data",
    "--model": "--model-path", "--target-model-path": "--model-path", "--verifier": "--model-path",
    "--tp": "--tp-size", "--tensor-parallel-size": "--tp-size", "--output": "--output-dir",
    "--save-dir": "--output-dir", "--out": "--output-dir", "--seq-length": "--max-seq-len",
    "--max-length": "--max-seq-len", "--max-model-len": "--max-seq-len", "--num-epochs": "--epochs",
    "--learning-rate": "--lr", "--draft-vocab": "--draft-vocab-size", "--hidden-states-path": "--hidden-states",
    "--layers": "--layer-ids", "--aux-layers": "--layer-ids",
}


def _suggest(flag, options):
    """The known flag a wrong one most likely meant: a known mistake, string similarity, or shared words."""
    if KNOWN_MISTAKES.get(flag) in options:
        return KNOWN_MISTAKES[flag]
    close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
    if close:
        return close[0]
    words = set(flag.lstrip("-").split("-"))
    scored = [(len(words & set(o.lstrip("-").split("-"))), o) for o in options]
    best = max(scored, default=(0, None))
    return best[1] if best[0] else None


class Parser(argparse.ArgumentParser):
    def __init__(self, **kw):
        kw.setdefault("allow_abbrev", False)
        kw.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(**kw)

    def error(self, message):
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m:
            options = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            parts = []
            for tok in m.group(1).split():
                if tok.startswith("-"):
                    name = tok.split("=")[0]
                    hint = _suggest(name, options)
                    parts.append(f"{name}" + (f" (did you mean {hint}?)" if hint else ""))
            message = "unknown flag " + ", ".join(parts) if parts else message
        print(f"error: {message}; see {self.prog} --help", file=sys.stderr, flush=True)
        sys.exit(2)


def at_least(args, **minimums):
    """Refuse any of the named flags below its minimum: at_least(args, epochs=1, max_seq_len=2)."""
    for dest, lo in minimums.items():
        v = getattr(args, dest)
        if v is not None and v < lo:
            raise UsageError(f"--{dest.replace('_', '-')} {v}: must be at least {lo}")


def int_list(text):
    """`2,15,27` or `2 15 27` -> [2, 15, 27]."""
    try:
        return [int(x) for x in re.split(r"[,\s]+", text.strip()) if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")


def shard(text):
    """`I/N` -> (I, N) with 0 <= I < N: replica I of N takes the rows whose index % N == I."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N (e.g. 0/2, 1/2), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def load_config(path, section):
    """The flat keys of a YAML config plus the keys of `section`, validated against CONFIG_KEYS."""
    import yaml

    if not os.path.isfile(path):
        raise UsageError(f"--config {path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UsageError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of keys to values at the top level")
    flat = {}
    for key, value in data.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise UsageError(f"--config {path}: section '{key}' must be a mapping")
            continue
        flat[key] = value
    if isinstance(data.get(section), dict):
        flat.update(data[section])
    for key, value in data.items():
        if key not in SECTIONS:
            _check_key(path, key, value)
    for s in SECTIONS:  # keys in every section are validated, so a typo anywhere is caught
        for key, value in (data.get(s) or {}).items():
            _check_key(path, key, value, where=f"{s}.")
    return flat


def _check_key(path, key, value, where=""):
    want = CONFIG_KEYS.get(key)
    if want is None:
        hint = difflib.get_close_matches(key, list(CONFIG_KEYS), n=1)
        raise UsageError(f"--config {path}: unknown key '{where}{key}'"
                         + (f" (did you mean '{hint[0]}'?)" if hint else ""))
    if value is None:
        return
    ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if want is list and ok:
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if not ok:
        kind = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
                list: "a list of integers"}[want]
        raise UsageError(f"--config {path}: key '{where}{key}' must be {kind}, got {value!r}")


def parse_args(parser, section, argv=None, required=(), aliases=None):
    """Parse flags with `--config` defaults. `aliases` maps a config key onto this script's dest (stage
    01's `--output-dir` defaults to the config's `prepared_data`). `required` dests must come from a flag or
    the config."""
    parser.add_argument("--config", help="YAML file giving defaults (explicit flags win)")
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config:
        values = load_config(known.config, section)
        dests = {a.dest: a for a in parser._actions}
        defaults = {}
        for key, value in values.items():
            dest = (aliases or {}).get(key, key)
            if dest in dests and value is not None:
                defaults[dest] = value
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    for dest in required:
        if getattr(args, dest) in (None, ""):
            flag = "--" + dest.replace("_", "-")
            raise UsageError(f"missing {flag} (give the flag, or '{dest}' in --config)")
    return args


def setup_logging():
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", stream=sys.stderr)
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger("eagle3")
