"""Output folders: which files a stage owns, the one-writer lock, and what a stage may delete.

The rules (an operator's folder holds their notes, their git repo, another run; losing one of their files is the
worst bug this project can have):
- An output path is refused when it is empty, `/`, the home folder, the repository root, the working folder, an
  ancestor of any of those, an input of the same run, inside an input, or containing one. A symlink is resolved
  first, so the checks apply to the real folder.
- A stage takes a folder only if it is new, empty (dot-files count: `.git/`, `.env` are someone's), or already
  holds only this stage's files. Which files are a stage's is written in the folder first, in `OWNER`, by exact
  name: `{"stage", "names": [...], "indexed": {"hs_{}.safetensors": N}}` (stage 02's N files hs_0 .. hs_{N-1}).
- A stage deletes or replaces only names its `OWNER` lists (and their temporary files `.<name>.tmp-<pid>` of
  processes that are gone); never by prefix or pattern, never the folder itself.
- One writer per folder: an advisory lock (`LOCK`) held for the whole run. `--shard` replicas share it and each
  holds its own shard lock; any other second run is refused with one line naming the process that holds it.
"""
import fcntl
import json
import os
import re
import shutil
import socket
import sys

from .cli import UsageError

OWNER = ".eagle3-owner.json"
LOCK = ".eagle3.lock"
# scripts/extract.sh opens its log before stage 02 starts: stage 02 accepts these, and never deletes them
LAUNCHER = re.compile(r"extract(\.shard-\d+)?\.(log|pid)")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TMP = re.compile(r"\.(.+)\.tmp-(\d+)")
_held = []  # the open lock files: a lock lives as long as the process


def _real(path):
    return os.path.realpath(os.path.expanduser(path))


def _inside(a, b):
    """a is b or lies inside b (both real paths)."""
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def check_path(flag, path, inputs=()):
    """The real output path, or a one-line refusal. `inputs`: [(flag, path)] of this run's local inputs."""
    if path is None or not str(path).strip():
        raise UsageError(f"{flag}: empty path; give a folder for this stage's output")
    real = _real(path)
    for what, p in (("the filesystem root", "/"), ("your home folder", os.path.expanduser("~")),
                    ("the repository root", REPO), ("the working folder", os.getcwd())):
        if _inside(_real(p), real):
            where = "is" if _real(p) == real else "contains"
            raise UsageError(f"{flag} {path}: {where} {what} ({_real(p)}); give a folder of its own")
    for in_flag, p in inputs:
        if not p or not os.path.exists(p):
            continue
        rin = _real(p)
        if _inside(real, rin) or _inside(rin, real):
            rel = "is" if rin == real else "is inside" if _inside(real, rin) else "contains"
            raise UsageError(f"{flag} {path}: {rel} the input {in_flag} {p}; give a separate output folder")
    if os.path.exists(real) and not os.path.isdir(real):
        raise UsageError(f"{flag} {path}: is a file, expected a folder")
    return real


def read_owner(folder):
    path = os.path.join(folder, OWNER)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
        ok = isinstance(m, dict) and isinstance(m.get("stage"), str) and isinstance(m.get("names"), list) \
            and isinstance(m.get("indexed", {}), dict)
    except (OSError, ValueError, RecursionError):
        ok = False
    if not ok:
        raise UsageError(f"{path}: unreadable ownership record; this folder's files cannot be told from others', "
                         f"so it is left alone: choose another folder")
    return m


class Owned:
    """The exact names a stage owns in a folder."""

    def __init__(self, names=(), indexed=None):
        self.names = set(names) | {OWNER, LOCK}
        self.indexed = dict(indexed or {})

    @classmethod
    def of(cls, record):
        return cls(record.get("names", ()), record.get("indexed"))

    def __or__(self, other):
        idx = dict(self.indexed)
        for k, n in other.indexed.items():
            idx[k] = max(n, idx.get(k, 0))
        return Owned(self.names | other.names, idx)

    def __contains__(self, name):
        if name in self.names:
            return True
        for template, n in self.indexed.items():
            head, tail = template.split("{}")
            mid = name[len(head): len(name) - len(tail)] if name.startswith(head) and name.endswith(tail) else ""
            # exact decimal rendering only: hs_007.safetensors or hs_1_backup.safetensors are not ours
            if mid.isdigit() and str(int(mid)) == mid and int(mid) < n:
                return True
        return False

    def temp_of(self, name):
        """The owned name a temporary file `.<name>.tmp-<pid>` belongs to, and its pid; else (None, None)."""
        m = TMP.fullmatch(name)
        if m and (m.group(1) in self or "." + m.group(1) in self):
            return m.group(1), int(m.group(2))
        return None, None

    def record(self, stage):
        return {"stage": stage, "names": sorted(self.names - {OWNER, LOCK}), "indexed": self.indexed}


def _foreign(folder, stage, owned):
    """The first entry of `folder` this stage does not own (launcher logs count as stage 02's)."""
    for name in sorted(os.listdir(folder)):
        if name in owned or owned.temp_of(name)[0] or (stage == "extract" and LAUNCHER.fullmatch(name)):
            continue
        return name
    return None


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder(folder, lock_name=LOCK):
    """Who holds a lock: its file's text; for the lock `--shard` replicas share, each replica's shard lock text."""
    names = [lock_name]
    if lock_name == LOCK:
        names += sorted(n for n in os.listdir(folder) if n.startswith(".eagle3.shard-") and n.endswith(".lock"))
    held = []
    for name in names:
        fd, free = _try_lock(folder, name, fcntl.LOCK_SH, create=False)
        if fd is not None:
            os.close(fd)
        if not free or name == lock_name:
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    text = f.read().strip()
            except OSError:
                text = ""
            if text and (not free or len(names) == 1):
                held.append(text)
    return "; ".join(held) or "another process"


def _try_lock(folder, name, mode, create):
    """An open file holding `mode` on folder/name, or None if another process holds a conflicting lock."""
    path = os.path.join(folder, name)
    if not create and not os.path.exists(path):
        return None, True
    fd = os.open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY, 0o644)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, False
    return fd, True


def check(flag, path, stage, owned, inputs=(), shard=None):
    """Every ownership rule, with no side effect (a dry run calls only this). -> the real path."""
    real = check_path(flag, path, inputs)
    if os.path.isdir(real):
        old = read_owner(real)
        if old and old["stage"] != stage:
            raise UsageError(f"{flag} {path}: holds the output of stage '{old['stage']}'; choose another folder")
        have = Owned.of(old) if old else Owned()
        name = _foreign(real, stage, have)
        if name is not None:
            what = "this stage did not make it" if old else "the folder is not empty and this stage did not make it"
            raise UsageError(f"{flag} {path}: holds '{name}' ({what}); a stage never deletes or replaces what it "
                             f"did not make: choose an empty or new folder")
        if not os.access(real, os.W_OK):
            raise UsageError(f"{flag} {path}: not writable")
        for lock_name, mode in _locks(shard):
            fd, free = _try_lock(real, lock_name, mode, create=False)
            if not free:
                raise UsageError(f"{flag} {path}: in use by another run ({_holder(real, lock_name)}); wait for it "
                                 f"to finish or stop it first")
            if fd is not None:
                os.close(fd)
    else:
        parent = os.path.dirname(real)
        while not os.path.isdir(parent):
            parent = os.path.dirname(parent)
        if not os.access(parent, os.W_OK):
            raise UsageError(f"{flag} {path}: cannot create it ({parent} is not writable)")
    return real


def _locks(shard):
    if shard:
        i, n = shard
        return [(LOCK, fcntl.LOCK_SH), (f".eagle3.shard-{i}-of-{n}.lock", fcntl.LOCK_EX)]
    return [(LOCK, fcntl.LOCK_EX)]


def claim(flag, path, stage, owned, inputs=(), shard=None, overwrite=False):
    """Check, create the folder if new, take the lock for this process's life, record what this run may write
    (`owned`, added to what earlier runs here recorded), and delete what a dead process left half-written. With
    `overwrite`, delete every file earlier runs of this stage recorded (the folder and anything else stay).
    -> the real path."""
    real = check(flag, path, stage, owned, inputs, shard)
    os.makedirs(real, exist_ok=True)
    locks = _locks(shard)
    if shard:  # every replica records every replica's lock name: their records stay the same whichever writes last
        owned = owned | Owned([f".eagle3.shard-{k}-of-{shard[1]}.lock" for k in range(shard[1])])
    for lock_name, mode in locks:
        fd, free = _try_lock(real, lock_name, mode, create=True)
        if not free:  # another run took it since check()
            raise UsageError(f"{flag} {path}: in use by another run ({_holder(real, lock_name)}); wait for it to "
                             f"finish or stop it first")
        if mode == fcntl.LOCK_EX:
            os.ftruncate(fd, 0)
            os.write(fd, f"PID {os.getpid()} on {socket.gethostname()}: {' '.join(sys.argv)}\n".encode())
        _held.append(fd)
    old = read_owner(real)
    have = Owned.of(old) if old else Owned()
    if overwrite:
        removed = remove_owned(real, have, keep=())
        if removed:
            import logging
            logging.getLogger("eagle3").info(f"--overwrite: removed {removed} file(s) earlier runs of this stage "
                                             f"made in {real} (nothing else)")
    from .files import write_json
    write_json(os.path.join(real, OWNER), (have | owned).record(stage))
    clean_temps(real, have | owned)
    return real


def clean_temps(folder, owned):
    """Delete temporary files of owned names whose writer process is gone (a live writer's are left alone)."""
    for name in os.listdir(folder):
        base, pid = owned.temp_of(name)
        if base and pid != os.getpid() and not pid_alive(pid):
            remove_path(os.path.join(folder, name))


def remove_owned(folder, owned, keep=()):
    """Delete the entries of `folder` that `owned` lists by exact name (except `keep` and the record and lock)."""
    n = 0
    for name in os.listdir(folder):
        if name in (OWNER, LOCK) or name in keep or (name.startswith(".eagle3.shard-") and name.endswith(".lock")):
            continue
        if name in owned or owned.temp_of(name)[0]:
            remove_path(os.path.join(folder, name))
            n += 1
    return n


def remove_path(path):
    """Delete one file, link or folder (callers decide it is theirs)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def add_owned(folder, names):
    """Record more exact names before making them (the lock holder only)."""
    from .files import write_json
    rec = read_owner(folder)
    write_json(os.path.join(folder, OWNER), (Owned.of(rec) | Owned(names)).record(rec["stage"]))
