"""Command-line plumbing shared by the numbered scripts.

- `Parser`: argparse with no abbreviations (so `--batch` never silently means `--batch-size`), one-line
  errors (`error: ...`, exit 2) and a "did you mean" for misspelled flags.
- `parse_args`: `--config configs/X.yaml` gives defaults, explicit flags win; returns the stage's frozen record
  (settings.py). A config file is one flat mapping shared by every stage, plus optional per-stage sections
  (`prepare:`, `extract:`, `vocab:`, `train:`, `evaluate:`) that override it. Unknown keys, keys a section's stage
  does not take, keys given twice and wrong types are refused.
- `UsageError` + `run`: any validation failure anywhere becomes one line on stderr and exit code 2; a `RunError`
  (a failure at run time, e.g. an extraction engine that died) one line and exit code 1.
Nothing here imports torch.
"""
import argparse
import difflib
import errno
import importlib.util
import logging
import os
import re
import reprlib
import signal
import sys
import traceback
import typing

from ..base import errors, inherited
from ..base.errors import RunError, UsageError, oneline, resume_hint  # noqa: F401 (the scripts' and tests' names for them)
from .. import REPO
from ..base.compute import CHOICES
from ..base.deadlines import check_environment
from ..base.inherited import check
from ..engines.engine_log import root_cause
from .flag_sources import explicit, refuse_contradictions
from .settings import OUTPUT_KEY, RECORDS, STAGES, _check_type, config_keys, kind, on_off_keys, path_fields


# errno -> what the operator does about it; the errors of a path they gave exit 2, the machine's state exits 1
_OS_HINTS = {
    errno.ENOSPC: (1, "the disk is full: free space (or choose another folder), then {resume}"),
    errno.EDQUOT: (1, "the disk quota is used up: free space, then {resume}"),
    errno.EFBIG: (1, "the file size limit was reached (ulimit -f, or the filesystem's): raise it, then rerun"),
    errno.EIO: (1, "an I/O error: check the disk, then {resume}"),
    errno.EROFS: (2, "the filesystem is read-only: choose a writable folder"),
    errno.EACCES: (2, "permission denied: check the path's permissions"),
    errno.EPERM: (2, "operation not permitted: check the path's permissions"),
    errno.ENAMETOOLONG: (2, "a name is too long for the filesystem: choose a shorter path"),
    errno.ELOOP: (2, "too many levels of symbolic links (a link loop?): fix the path"),
    errno.ENOENT: (2, "no such file or folder (was the working folder deleted?): check the path"),
    errno.ENOTDIR: (2, "a part of the path is not a folder: check the path"),
    errno.EISDIR: (2, "a folder stands where a file is expected: check the path"),
    errno.EMFILE: (1, "too many open files: raise ulimit -n, then rerun"),
}


def describe(e, advice=True):
    """Any exception as (exit code, one line): ours as they are; the OS's, memory, decoding and the libraries' own
    (validation errors raised inside speculators, vLLM, transformers) with what it was and what to do. `advice`
    False: an out-of-memory as its figures alone (a failure the run carries on after: what to rerun is no advice)."""
    text = str(e)
    if "Traceback (most recent call last)" in text:  # a child's (a data-loader worker's) traceback re-raised here:
        # the cause it names, not the wrappers around it
        cause = root_cause(text.splitlines()) or [line for line in text.splitlines() if line.strip()][-1]
        text = re.sub(r"^[\w.]+: ", "", cause)
    if isinstance(e, UsageError):
        return 2, text
    if isinstance(e, RunError):
        return 1, text
    if isinstance(e, OSError) and e.errno in _OS_HINTS:
        code, hint = _OS_HINTS[e.errno]
        names = " -> ".join(os.fsdecode(n) for n in (e.filename, e.filename2) if n is not None)
        return code, f"{names + ': ' if names else ''}{e.strerror}; {hint.format(resume=resume_hint())}"
    if type(e).__name__ == "OutOfMemoryError" and type(e).__module__.split(".")[0] == "torch":
        line, more = errors.gpu_out_of_memory(text), errors.MEMORY.get("gpu")
        if not advice:
            return 1, line
        return 1, f"{line}; free the GPU, then {resume_hint()}{f'; or {more}' if more else ''}"
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "DefaultCPUAllocator" in text):
        line, more = errors.host_out_of_memory(text), errors.MEMORY.get("host")
        if not advice:
            return 1, line
        return 1, f"{line}; free memory, then {resume_hint()}; or {more or 'lower --batch-size or --max-seq-len'}"
    if isinstance(e, UnicodeError):
        return 2, f"text that is not valid UTF-8 ({' '.join(str(e).split())[:200]}); fix or drop the record or name"
    if isinstance(e, RecursionError):
        return 2, "an input nested too deep to read; check the last file or record named above"
    where = type(e).__module__.split(".")[0]
    what = " ".join(text.split())[:300] or "no message"
    origin = f" (raised in {where})" if where not in ("builtins", "eagle3pipe", "__main__") else ""
    return 1, f"{type(e).__name__}{origin}: {what}; set EAGLE3_DEBUG=1 for the traceback"


def run(main, exit_now=False):
    """Run a script's main(); every failure becomes one line `error: ...` on stderr (cli.describe): exit code 2 for
    input the operator fixes (a UsageError, a bad path), 1 for a failure at run time. EAGLE3_DEBUG=1 prints the
    traceback first. `exit_now`: once main() has returned (its files written, its lock no longer needed), leave
    without waiting for the interpreter's shutdown, which in stage 04 waits minutes on data-loader and compile
    worker processes and their semaphores."""
    inherited.guard()  # before anything opens a file: a closed fd 1 would otherwise become the lock or the record
    _stop_on_signals()
    try:
        code = main()
    except KeyboardInterrupt as e:
        sig = getattr(e, "signum", signal.SIGINT)
        print(f"error: stopped by a signal ({signal.Signals(sig).name}); {resume_hint()}",
              file=sys.stderr, flush=True)
        code = 128 + sig
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the one place every failure becomes one line
        if os.environ.get("EAGLE3_DEBUG"):
            traceback.print_exc()
        if isinstance(e, UsageError) and _CONFIGURED:  # a later check's refusal of a value only the config gave
            e = _named_by_config(e, *_CONFIGURED)
        code, line = describe(e)
        try:
            print(f"error: {oneline(line)}", file=sys.stderr, flush=True)
        except OSError:
            pass
    if "eagle3pipe.storage.outdir" in sys.modules:  # the logs this run appended to, recorded as finished
        try:
            sys.modules["eagle3pipe.storage.outdir"].finish()
        except Exception:  # noqa: BLE001 - a record that cannot be updated leaves the folder as it was
            pass
    if exit_now or code not in (None, 0):
        logging.shutdown()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:
            pass
        if exit_now:
            os._exit(code or 0)
    sys.exit(code or 0)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP where the stage set no handler of its own: the same way out as Ctrl-C (one line)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _stop_on_signals():
    def stop(signum, frame):
        raise Stopped(signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:  # nohup's ignored SIGHUP stays ignored
            signal.signal(sig, stop)


def add_dtype_flag(parser, what="the model"):
    """`--dtype`, the same in every stage that runs a model (eagle3pipe/base/compute.py chooses for auto)."""
    parser.add_argument("--dtype", choices=list(CHOICES), default="auto",
                        help=f"what {what} computes in: auto = bf16 on GPUs and on CPUs with native bf16 (avx512_bf16, "
                             f"amx_bf16, Arm bf16), float32 on other CPUs, where bf16 is emulated 3-4x slower; "
                             f"stored files are bf16 either way")


# Flag names operators bring from other tools (speculators, SpecForge, vLLM) and from older versions.
KNOWN_MISTAKES = {
    "--data-path": "--prepared-data", "--data-dir": "--prepared-data", "--data": "--prepared-data",
    "--model": "--model-path", "--target-model-path": "--model-path", "--verifier": "--model-path",
    "--tp": "--tp-size", "--tensor-parallel-size": "--tp-size", "--output": "--output-dir",
    "--save-dir": "--output-dir", "--out": "--output-dir", "--seq-length": "--max-seq-len",
    "--max-length": "--max-seq-len", "--max-model-len": "--max-seq-len", "--num-epochs": "--epochs",
    "--learning-rate": "--lr", "--draft-vocab": "--draft-vocab-size", "--hidden-states-path": "--hidden-states",
    "--layers": "--layer-ids", "--aux-layers": "--layer-ids",
    "--draft-vocab-size": "--vocab-mapping",  # stage 03's flag: later stages take the map it built
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

    def parse_known_args(self, args=None, namespace=None):
        # `--layer-ids -1,15,27`: argparse reads a value starting with '-' as a flag ("expected one argument");
        # joined as `--layer-ids=-1,15,27`, the value reaches its check, which names it
        args = list(sys.argv[1:] if args is None else args)
        lists = {o for a in self._actions if a.type is int_list for o in a.option_strings}
        for i in range(len(args) - 1, 0, -1):
            if args[i - 1] in lists and re.fullmatch(r"-\d[\d,\s-]*", args[i]):
                args[i - 1:i + 1] = [f"{args[i - 1]}={args[i]}"]
        return super().parse_known_args(args, namespace)

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
        print(f"error: {oneline(message)}; see {self.prog} --help", file=sys.stderr, flush=True)
        sys.exit(2)


def load_script(name):
    """A numbered script of this repository (e.g. "04_train.py") imported as a module, for its parse_args, without
    running its main()."""
    spec = importlib.util.spec_from_file_location("stage" + name.split("_")[0], os.path.join(REPO, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def int_list(text):
    """`2,15,27` or `2 15 27` -> [2, 15, 27]."""
    parts = re.split(r"\s*,\s*|\s+", text.strip())
    try:  # an empty item ("2,,15", "2,15,") is a typo that would drop a layer: refused, not skipped
        values = [int(x) for x in parts] if all(parts) else None
    except ValueError:
        values = None
    if not values:  # an empty list would silently mean the default
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")
    return values


def shard(text):
    """`I/N` -> (I, N) with 0 <= I < N: replica I of N takes the rows whose index % N == I."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N (e.g. 0/2, 1/2), got {text!r}")
    return int(m.group(1)), int(m.group(2))


MAX_CONFIG_BYTES = 1 << 20  # a config is a page of keys, not a data file
MAX_ALIASES = 64  # anchors and aliases are fine in moderation; a "billion laughs" expansion is not a config


def _yaml_loader():
    """yaml's SafeLoader, refusing a key given twice in one mapping (yaml itself keeps the last silently), a key that
    is not a plain scalar, and more than MAX_ALIASES aliases. Merge keys (`<<: *anchor`) work as in YAML."""
    import yaml

    class Loader(yaml.SafeLoader):
        aliases = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.events.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_ALIASES:
                    raise yaml.composer.ComposerError(None, None, f"more than {MAX_ALIASES} aliases",
                                                      self.peek_event().start_mark)
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: yaml merges it; a key given
                    continue  # beside it overrides the merged one, as YAML says
                if not isinstance(key_node, yaml.ScalarNode):
                    raise yaml.constructor.ConstructorError(
                        None, None, f"a key must be a plain name, not a {key_node.id} (line "
                                    f"{key_node.start_mark.line + 1})", key_node.start_mark)
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key '{key}' given twice (line {key_node.start_mark.line + 1})",
                        key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)
    return Loader


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")  # what YAML 1.1 leaves a string: 3e-3, 1E5


def load_config(path, section, own=None, origin=None):
    """The config keys that apply to stage `section`: the top level's keys this stage takes, then its own section's.
    Every key anywhere is checked: a top-level key must be some stage's, a section's key that stage's, each with
    its type; a key twice is refused. -> {record field: value}; `own`, a set, gets the fields that are this stage's
    alone: its section's, and top-level keys no other stage takes; `origin`, a dict, each field's key as the file
    spells it ('train.lr', or 'lr' at the top level), for messages."""
    import yaml

    if not os.path.exists(path):
        raise UsageError(f"--config {path}: file not found")
    if not os.path.isfile(path):
        raise UsageError(f"--config {path}: not a regular file")
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise UsageError(f"--config {path}: {os.path.getsize(path):,} bytes; a config is at most "
                         f"{MAX_CONFIG_BYTES:,} bytes of keys")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_yaml_loader()) or {}
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: undecodable bytes, an int too long
        raise UsageError(f"--config {path}: not valid YAML ({' '.join(str(e).split())[:200]})")
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of keys to values at the top level")
    keys = {s: config_keys(s) for s in STAGES}
    anywhere = {k: v for s in STAGES for k, v in keys[s].items()}
    out = {}

    def one_or_list(value, allowed, key):  # a list-of-paths key (evaluate.draft) also takes one path
        hint = (allowed.get(key) or (None, None))[1]
        if isinstance(value, str) and float in (hint, *typing.get_args(hint)) and _FLOAT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads 3e-3 (no dot) as a string; the flag takes it as a number
        if isinstance(value, bool) and hint is str and key in on_off_keys():  # YAML 1.1 reads a bare on/off
            return "on" if value else "off"                                   # (yes/no) as true/false
        return [value] if isinstance(value, str) and typing.get_args(hint) == (str,) else value
    for key, value in list(data.items()):
        if key in STAGES:
            if not isinstance(value, dict):
                raise UsageError(f"--config {path}: section '{key}' must be a mapping")
            for k, v in list(value.items()):
                value[k] = one_or_list(v, keys[key], k)
                _check_key(path, k, value[k], keys[key], f"{key}.", kind)
            continue
        data[key] = value = one_or_list(value, anywhere, key)
        _check_key(path, key, value, anywhere, "", kind)
        if key in keys[section] and value is not None:
            out[keys[section][key][0]] = value
            if origin is not None:
                origin[keys[section][key][0]] = key
            if own is not None and sum(key in keys[s] for s in STAGES) == 1:  # a top-level key no other stage takes
                own.add(keys[section][key][0])
    for k, v in (data.get(section) or {}).items():
        if v is not None:
            out[keys[section][k][0]] = v
            if origin is not None:
                origin[keys[section][k][0]] = f"{section}.{k}"
            if own is not None:
                own.add(keys[section][k][0])
    return out


def _check_key(path, key, value, allowed, where, kind):
    if key not in allowed:
        hint = difflib.get_close_matches(str(key), [str(k) for k in allowed], n=1)
        stage = f" (stage {where[:-1]} does not take it)" if where else ""
        if key == "output_dir":  # a run-only flag: in a config, a stage's output folder is its product's key
            if where:
                hint = [OUTPUT_KEY[where[:-1]]]
            else:
                stage = (" (a stage's output folder is named by its product's key: "
                         f"{', '.join(f'{k}: {v}' for k, v in OUTPUT_KEY.items())})")
        raise UsageError(f"--config {path}: unknown key '{where}{key}'{stage}"
                         + (f"; did you mean '{hint[0]}'?" if hint else ""))
    if value is None:
        return
    if allowed[key][0] in path_fields() and isinstance(value, str) and not value.strip():
        raise UsageError(f"--config {path}: key '{where}{key}' is empty; give a value, or leave the key out")
    if isinstance(value, (list, tuple)) and not value:  # an empty list would read as "not given": the default
        raise UsageError(f"--config {path}: key '{where}{key}' is an empty list; give its values, or leave the key "
                         f"out for the default")
    hint_type = allowed[key][1]
    try:
        _check_type(key, value, hint_type)
    except UsageError:
        raise UsageError(f"--config {path}: key '{where}{key}' must be {kind(hint_type)}, got {reprlib.repr(value)}")


def parse_args(parser, section, argv=None, required=(), derive=None):
    """Parse flags with `--config` defaults, then build the stage's frozen, validated record (settings.py).
    `required` dests must come from a flag or the config; `derive(namespace)` fills defaults that depend on others."""
    parser.add_argument("--config", help="YAML file giving defaults (explicit flags win)")
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    configured, own, origin = {}, set(), {}
    if known.config is not None:
        if not known.config.strip():
            raise UsageError("--config: empty path")
        configured = load_config(known.config, section, own, origin)
        parser.set_defaults(**configured)
    args = parser.parse_args(argv)
    for dest in required:
        if getattr(args, dest) in (None, ""):
            flag = "--" + dest.replace("_", "-")
            raise UsageError(f"missing {flag} (give the flag, or '{dest}' in --config)")
    if derive:
        derive(args)
    given = explicit(parser, sys.argv[1:] if argv is None else argv)
    from_config = set(configured) - set(given)
    try:
        record = RECORDS[section].from_args(args)
    except UsageError as e:  # a value the config file gave is named by its key there, not by a flag nobody typed
        raise _named_by_config(e, from_config, known.config, origin) from None
    global _CONFIGURED
    _CONFIGURED = (from_config, known.config, origin) if known.config is not None else None
    check_environment()
    check()
    refuse_contradictions(section, record, given, from_config, known.config, own - set(given), origin)
    return record


_CONFIGURED = None  # (fields only the config gave, its path, their keys): set by parse_args for run's last line


def _named_by_config(error, from_config, path, origin):
    """`error` ("--flag value: why", "--a and --b: why") about fields only the config set -> the same about their
    keys in the config ('train.lr', or 'lr' at the top level: where the operator finds it); a flag typed stays."""
    msg = str(error)
    head, sep, rest = msg.partition(": ")  # what the line is about: "--lr 0.5", "--norm-before-fc and --fc-norm"
    named = head
    for field in from_config:
        if field in origin:
            named = re.sub(rf"(?<![\w-])--{re.escape(field.replace('_', '-'))}(?![\w-])",
                           lambda m: f"key '{origin[field]}'", named)
    return UsageError(f"--config {path}: {named}{sep}{rest}") if named != head else error


class _OneLine(logging.Formatter):
    """Each record one physical line: a newline or control character in a file name is escaped."""

    def format(self, record):
        return oneline(super().format(record))


def setup_logging():
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(_OneLine(handler.formatter._fmt, handler.formatter.datefmt))
    for noisy in ("httpx", "httpx2", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger("eagle3")
