"""What a stage made in its output folder: the ownership record (`LEDGER`) and each entry's identity.

Ownership is identity, recorded after creation: one JSON line per thing the stage made, written right after it
exists, with its path inside the folder and its identity (kind, device, inode, and for a finished file its size,
modification time and a hash of its first bytes). A user's file of the same name, or our file edited since, does
not match, so outdir.py never deletes or replaces it. The record is append-only between claims (`--shard`
replicas and loader workers append to one record; each line is one O_APPEND write) and compacted by the lock
holder at each claim.
"""
import hashlib
import json
import os
import re
import secrets
import stat
import threading

from ..base.errors import RunError, UsageError, quote

LEDGER = ".eagle3-owner.jsonl"
OLD_RECORD = ".eagle3-owner.json"  # by-name records of earlier versions: their names cannot be told from a user's
TEMP = re.compile(r"\..+\.tmp-\d+-[0-9a-f]{8}")  # a temporary name: `.<name>.tmp-<pid>-<8 random hex digits>`
MAX_LEDGER = 1 << 30  # bytes: a record longer than this was not written by a stage
# A record grows with what the stage made: a line or three per file between compactions (every claim compacts), a
# few hundred bytes a line. Past this base plus this much per name in the folder it is not a stage's record, and
# reading it (minutes for millions of lines) would be a wait without an answer.
LEDGER_BASE, LEDGER_PER_NAME = 16 << 20, 2 << 10
# kinds: a finished file (size and time must match), a growing file (a log: its inode), a folder, a link, a
# temporary file (being written: its inode)
KINDS = {"f", "g", "d", "l", "t"}
claimed = {}  # real folder -> Ledger, for the folders this process claimed
_mutex = threading.Lock()


def inside(a, b):
    """a is b or lies inside b (both real paths)."""
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def temp_name(path):
    """A fresh temporary name beside `path` (TEMP's form): `.<name>.tmp-<pid>-<8 random hex digits>`."""
    d, name = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def exclusive_temp(path):
    """(temporary path, fd) beside `path`, created with O_EXCL|O_NOFOLLOW: a planted file or link is never opened."""
    d, name = os.path.split(os.path.abspath(path))
    for _ in range(8):
        tmp = temp_name(path)
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            continue
    raise RunError(f"{quote(d)}: cannot create a temporary file beside {quote(name)}")


HEAD = 4096  # a finished file's identity includes a hash of its first bytes (a header and its checksum, a manifest)


def _head_hash(path, n=HEAD):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        return hashlib.sha256(os.read(fd, n)).hexdigest()[:16]
    finally:
        os.close(fd)


def identity(st, path=None):
    """[kind, device, inode, size, mtime_ns, head hash ('' unless a finished file's `path` is given)] of an lstat
    result."""
    kind = "d" if stat.S_ISDIR(st.st_mode) else "l" if stat.S_ISLNK(st.st_mode) else "f"
    head = _head_hash(path) if path and kind == "f" else _target(path) if path and kind == "l" else ""
    return [kind, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, head]


def _target(path):
    try:
        return os.readlink(path)[:1024]
    except OSError:
        return ""


def matches(recorded, st, path):
    """Whether what is at `path` now (lstat `st`) is what the record says the stage made there:
    - its modification time to the nanosecond, on the same inode or on a copy that kept times (cp -a, rsync -a,
      shutil.copytree): a file of ours whose data went bad, or that a dying disk truncated, is ours to redo (on a
      filesystem whose times are whole seconds, the same inode or size is needed too);
    - or its first bytes (HEAD), on the same inode or with the same size on a copy (a bit flipped in a copy).
    A file written in its place, even on a reused inode, has a new time and other first bytes: not ours. A link
    matches by where it points; a folder by kind (deleting an empty folder loses nothing, and a folder is deleted
    only once everything in it was the stage's).
    """
    kind = recorded[0]
    now = identity(st)
    same_inode = tuple(recorded[1:3]) == tuple(now[1:3])
    if kind == "f":
        if now[0] != "f":
            return False
        same_head = bool(recorded[5]) and recorded[5] == _head_hash(path)
        same_time = recorded[4] == now[4]
        fine_time = same_time and recorded[4] % 1_000_000_000 != 0  # a time to the ns is no accident; to the s might be
        return fine_time or ((same_time or same_head) and (same_inode or recorded[3] == now[3]))
    if kind == "g":  # a log this stage appends to: what it held then is still its start (on the same inode, or on a
        # copy at least as long); on the same inode a file rewritten from its start by someone else is not ours
        n = min(recorded[3], HEAD)
        same_start = n > 0 and now[3] >= recorded[3] and recorded[5] == _head_hash(path, n)
        return now[0] == "f" and ((same_inode and (n == 0 or same_start)) or same_start)
    if kind == "t":  # a temporary file or link, recorded before it exists: its fresh random name identifies it
        return now[0] in ("f", "l") and bool(TEMP.fullmatch(os.path.basename(path)))
    if kind == "l":
        return now[0] == "l" and recorded[5] == _target(path)
    return kind == now[0]


def _apply(entries, lines):
    """Fold record lines into {relative path: identity}; ValueError for a line a stage did not write."""
    for line in lines:
        if not line.strip():
            continue
        rel, ident = json.loads(line)
        if not isinstance(rel, str) or not _plain(rel):
            raise ValueError
        if ident is None:
            entries.pop(rel, None)
            continue
        if not (isinstance(ident, list) and len(ident) == 6 and ident[0] in KINDS
                and all(type(x) is int for x in ident[1:5]) and isinstance(ident[5], str)):
            raise ValueError
        if ident[0] == "t" and not TEMP.fullmatch(rel.rsplit("/", 1)[-1]):
            raise ValueError  # only a fresh temporary name is identified by its name
        entries[rel] = ident


def _plain(rel):
    parts = rel.split("/")
    return 0 < len(rel) < 4096 and "\0" not in rel and all(p not in ("", ".", "..") for p in parts)


def _names_in(root):
    with os.scandir(root) as it:
        return sum(1 for _ in it)


def _ledger_budget(root, size):
    """The most bytes a record of `root` may hold (only counted when the record is past the base)."""
    return size if size <= LEDGER_BASE else LEDGER_BASE + LEDGER_PER_NAME * _names_in(root)


class Ledger:
    """The identities of what a stage made in one folder: {relative path: identity}, from `LEDGER`."""

    def __init__(self, root, stage, entries, offset=0):
        self.root, self.stage, self.entries, self.fd, self.offset = root, stage, entries, None, offset
        self.version, self._temps = 0, None  # _temps: (version, {target rel: [identity]}), rebuilt after a change

    @classmethod
    def load(cls, root):
        """The folder's record, or None if it has none; a malformed one is one line and nothing is touched."""
        path = os.path.join(root, LEDGER)
        def bad(why="unreadable"):
            return f"{quote(path)}: {why} ownership record; this folder's files cannot be told from others', so " \
                   f"it is left alone: choose another folder"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError:
            raise UsageError(bad("a linked or unreadable" if os.path.islink(path) else "an unreadable"))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(bad("a non-regular"))
            if st.st_nlink != 1:
                raise UsageError(bad("a hard-linked (shared with another path)"))
            if st.st_size > min(MAX_LEDGER, _ledger_budget(root, st.st_size)):
                raise UsageError(bad(f"an oversized ({st.st_size:,} bytes for a folder of "
                                     f"{_names_in(root):,} entries)"))
            data = f.read()
        data = data[:data.rfind(b"\n") + 1]  # a line another replica is appending right now is read next time
        lines = data.splitlines()
        try:
            head = json.loads(lines[0])
            if not (isinstance(head, dict) and isinstance(head.get("stage"), str) and head.get("version") == 2):
                raise ValueError
            entries = {}
            _apply(entries, lines[1:])
        except (ValueError, TypeError, IndexError, RecursionError):
            raise UsageError(bad("a malformed"))
        return cls(root, head["stage"], entries, len(data))

    def refresh(self):
        """Read what other processes (`--shard` replicas, loader workers) appended since."""
        try:
            fd = os.open(os.path.join(self.root, LEDGER), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return
        with os.fdopen(fd, "rb") as f:
            new = os.fstat(f.fileno()).st_size - self.offset
            f.seek(self.offset)
            # what was appended, not read(MAX_LEDGER): that reserves a GiB each time, and under `ulimit -v` (as on
            # many clusters) the stage failed at its end as "out of memory"
            data = f.read(min(max(new, 0), MAX_LEDGER))
        data = data[:data.rfind(b"\n") + 1]
        try:
            with _mutex:
                _apply(self.entries, data.splitlines())
                self.offset += len(data)
                self.version += 1
        except (ValueError, TypeError, IndexError, RecursionError):
            pass  # a record damaged since: the next stage run names it

    def owns(self, rel, fresh=False):
        ident = self.entries.get(rel)
        try:
            path = os.path.join(self.root, rel)
            if ident is not None and self._real_parents(rel) and matches(ident, os.lstat(path), path):
                return True
            if self._renamed_temp(rel, path):
                return True
        except OSError:
            return False
        if not fresh:  # another process of this stage may have remade it since this one read the record
            self.refresh()
            return self.owns(rel, fresh=True)
        return False

    def _renamed_temp(self, rel, path):
        """Whether `path` is a finished temporary file of the stage, renamed onto `rel` by a process killed before it
        recorded the new name: outdir.install records the temporary's whole identity (inode, size, time, first bytes
        or link target; a rename keeps them all) before the rename, under the temporary's fresh name beside `rel`."""
        candidates = self._renamed_temps().get(rel)
        if not candidates or not self._real_parents(rel):
            return False
        st = os.lstat(path)
        kind = "l" if stat.S_ISLNK(st.st_mode) else "f"
        return any(matches([kind, *i[1:]], st, path) for i in candidates)

    def _renamed_temps(self):
        """{target rel: [identity]} of the temporary names recorded with a whole identity (outdir.install, before
        its rename): one pass over the record after each change, not one per question."""
        if self._temps is None or self._temps[0] != self.version:
            index = {}
            for r, i in list(self.entries.items()):
                if i[0] == "t" and i[2]:
                    d, _, name = r.rpartition("/")
                    index.setdefault((f"{d}/" if d else "") + name[1:].rsplit(".tmp-", 1)[0], []).append(i)
            self._temps = (self.version, index)
        return self._temps[1]

    def adopt_renamed(self):
        """Record under its own name each finished temporary file a killed process renamed into place before it
        recorded the new name (_renamed_temp): the claim then forgets the dead writer's temporary names. Only while
        holding the folder's lock."""
        for target in list(self._renamed_temps()):
            path = os.path.join(self.root, target)
            mine = self.entries.get(target)
            try:
                if not (mine and matches(mine, os.lstat(path), path)) and self._renamed_temp(target, path):
                    self.append(target, identity(os.lstat(path), path))
            except OSError:  # nothing at that name
                continue

    def _real_parents(self, rel):
        """Every folder on the way to `rel` is one the stage made and a real folder: a path through a link (planted, or
        listed in a hand-edited record) is never the stage's."""
        parts = rel.split("/")[:-1]
        for k in range(1, len(parts) + 1):
            parent = "/".join(parts[:k])
            if (self.entries.get(parent) or ["?"])[0] != "d" or \
                    not stat.S_ISDIR(os.lstat(os.path.join(self.root, parent)).st_mode):
                return False
        return True

    def append(self, rel, ident):
        line = (json.dumps([rel, ident]) + "\n").encode()
        with _mutex:
            if self.fd is None:
                self.fd = os.open(os.path.join(self.root, LEDGER),
                                  os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
            os.write(self.fd, line)  # one write with O_APPEND: replicas' lines never interleave
            self.version += 1
            if ident is None:
                self.entries.pop(rel, None)
            else:
                self.entries[rel] = ident

    def write_new(self, stage):
        """A fresh, compacted record (only while holding the folder's exclusive lock)."""
        tmp = exclusive_temp(os.path.join(self.root, LEDGER))
        with os.fdopen(tmp[1], "w", encoding="utf-8") as f:
            f.write(json.dumps({"stage": stage, "version": 2}) + "\n")
            for rel, ident in sorted(self.entries.items()):
                f.write(json.dumps([rel, ident]) + "\n")
            self.offset = f.tell()
        os.replace(tmp[0], os.path.join(self.root, LEDGER))
        self.stage = stage
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def ledger_of(path):
    """(ledger, path relative to its folder) for a path inside a folder this process claimed, else (None, None)."""
    a = os.path.abspath(path)
    for root, led in claimed.items():
        if inside(a, root) and a != root:
            return led, os.path.relpath(a, root).replace(os.sep, "/")
    return None, None


def open_beneath(path, flags, mode=0o644):
    """os.open of `path` with O_NOFOLLOW on every component below the claimed folder holding it (walked with
    dir_fd), so a subfolder swapped for a link after it was checked is never followed; plain os.open elsewhere."""
    led, rel = ledger_of(path)
    if led is None:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    parts = rel.split("/")
    fd = os.open(led.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return os.open(parts[-1], flags | os.O_NOFOLLOW, mode, dir_fd=fd)
    finally:
        os.close(fd)


def open_plain(path, flags, error, what, todo):
    """An fd of the plain file at `path`, opened without following a link (and without blocking on a FIFO); else
    `error` (one line)."""
    try:
        fd = open_beneath(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise error(f"{quote(path)}: {what} ({'a link' if os.path.islink(path) else e.strerror}); {todo}")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        why = "not a plain file" if not stat.S_ISREG(st.st_mode) else "a hard link: another name shares its contents"
        raise error(f"{quote(path)}: {what} ({why}); {todo}")
    return fd


def attach(root):
    """In a helper process of the lock holder (a spawned data-loader worker): record into the holder's folder too."""
    real = os.path.realpath(root)
    if real not in claimed and os.path.isfile(os.path.join(real, LEDGER)):
        led = Ledger.load(real)
        if led is not None:
            claimed[real] = led


def owned(path):
    """True when `path` is inside a claimed folder and is what the stage made there."""
    led, rel = ledger_of(path)
    return bool(led and led.owns(rel))


def record(path, kind=None):
    """Record what the stage just made at `path` (a file, a folder, a link; `kind` 'g' for a log that grows). Outside
    a claimed folder (a model conversion, a test's own file) there is nothing to record."""
    led, rel = ledger_of(path)
    if led is None:
        return
    ident = identity(os.lstat(path), path if kind in (None, "f", "l") else None)
    if kind:
        ident[0] = kind
    if kind == "g":  # only appended to: its first bytes as they are now stay what they are
        ident[5] = _head_hash(path, min(ident[3], HEAD)) if ident[3] else ""
    led.append(rel, ident)


def record_tree(path):
    """Record a folder another library wrote for this stage (speculators' checkpoint), and everything in it."""
    record(path)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            record(os.path.join(dirpath, name))


def forget(path):
    led, rel = ledger_of(path)
    if led is not None and rel in led.entries:
        led.append(rel, None)
