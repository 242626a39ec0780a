"""The one-writer lock on a stage's output folder: taking it, naming its holder, and reading who holds it.

One writer per folder: an advisory lock (`LOCK`) held for the whole run, its file's first line naming the holder
(PID, host, command). `--shard` replicas share it (shared mode) and each holds its own shard lock. A launcher takes
the locks for the stage it starts and hands them over (handoff.py). Lock files are opened never through a link.
"""
import fcntl
import os
import re
import socket
import sys
import time

from ..base import handoff
from ..base.errors import UsageError, quote
from .ledger import open_plain

LOCK = ".eagle3.lock"
SHARD_LOCK = re.compile(r"\.eagle3\.shard-\d+-of-\d+\.lock")
_held = []  # the open lock files: a lock lives as long as the process


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


UNNAMED = "another process"  # a holder whose lock names no one: it took the lock a moment ago, or is not ours
NAMING_S = 1.0  # how long a reader waits for a lock taken a moment ago to name its holder (microseconds, normally)


def name_lock(fd, text):
    """Write who holds a lock into its file. The new line goes over the old one before the file is cut to it, so a
    reader at any moment sees a whole line, old or new (it reads the first line), never an empty file."""
    data = (text.strip() + "\n").encode("utf-8", "backslashreplace")  # a name in Latin-1 bytes stays readable
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _lock_text(path):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            return os.read(fd, 4096).decode("utf-8", "replace").split("\n", 1)[0].strip()
        finally:
            os.close(fd)
    except OSError:
        return ""


def holder(folder, lock_name=LOCK):
    """Who holds a lock: its file's first line; for the lock `--shard` replicas share, each replica's shard lock
    text. A held lock with no text yet is read again for up to NAMING_S: its holder is between taking and naming it."""
    names = [lock_name]
    if lock_name == LOCK:
        names += sorted(n for n in os.listdir(folder) if SHARD_LOCK.fullmatch(n))
    deadline = time.monotonic() + NAMING_S
    while True:
        held, unnamed = [], False
        for name in names:
            fd, free = try_lock(folder, name, fcntl.LOCK_SH, create=False)
            if fd is not None:
                os.close(fd)
            text = _lock_text(os.path.join(folder, name))
            if text and not _alive(text):  # a lock file copied with its folder names a process that is gone
                text = ""
            if text and (not free or len(names) == 1):
                held.append(quote(text))
            unnamed |= not free and not text
        if held or not unnamed or time.monotonic() >= deadline:
            return "; ".join(held) or UNNAMED
        time.sleep(0.02)


def _alive(text):
    """False for a holder line that names a process of this host that no longer runs (the text survives a copy of
    the folder and a shared lock's later holders; the lock itself does not)."""
    m = re.match(r"PID (\d+) on (\S+): ", text)
    return m is None or m.group(2) != socket.gethostname() or pid_alive(int(m.group(1)))


def try_lock(folder, name, mode, create):
    """An open file holding `mode` on folder/name, or None if another process holds a conflicting lock. The lock file
    is never a link: O_NOFOLLOW, and a link there is one line."""
    path = os.path.join(folder, name)
    if not create and not os.path.lexists(path):
        return None, True
    fd = open_plain(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY, UsageError, "cannot be the lock",
                     "a stage never opens a link it did not make: remove it and rerun")
    handed = handoff.lock_for(fd, mode)  # the launcher that started this process took this lock for it (launch.py)
    if handed is not None:
        os.close(fd)
        return handed, True
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, False
    return fd, True


def lock_names(shard):
    """The locks a run with `shard` takes on its folder, each with its mode: the folder's (shared by `--shard`
    replicas) and the replica's own."""
    if shard:
        i, n = shard
        return [(LOCK, fcntl.LOCK_SH), (f".eagle3.shard-{i}-of-{n}.lock", fcntl.LOCK_EX)]
    return [(LOCK, fcntl.LOCK_EX)]


def held_lock(folder, name=LOCK):
    """This process's open file holding its lock on folder/name (what a launcher hands the stage it starts), or None."""
    try:
        st = os.lstat(os.path.join(os.path.realpath(folder), name))
    except OSError:
        return None
    for fd in _held:
        f = os.fstat(fd)
        if (f.st_dev, f.st_ino) == (st.st_dev, st.st_ino):
            return fd
    return None


def lock_holder(folder, shard=None):
    """Who holds a lock a run with `shard` would need on `folder` (the text a refusal names), or None if all are free."""
    real = os.path.realpath(folder)
    if not os.path.isdir(real):
        return None
    for lock_name, mode in lock_names(shard):
        fd, free = try_lock(real, lock_name, mode, create=False)
        if fd is not None:
            os.close(fd)
        if not free:
            return holder(real, lock_name)
    return None


def take(flag, path, real, shard):
    """Take the locks a run with `shard` needs on `real` for this process's life, naming it as the holder; another run
    holding one is a one-line refusal naming it."""
    for lock_name, mode in lock_names(shard):
        fd, free = try_lock(real, lock_name, mode, create=True)
        if not free:  # another run took it since the check
            raise UsageError(f"{flag} {path}: in use by another run ({holder(real, lock_name)}); wait for it to "
                             f"finish or stop it first")
        if mode == fcntl.LOCK_EX:
            name_lock(fd, f"PID {os.getpid()} on {socket.gethostname()}: {' '.join(sys.argv)}")
        _held.append(fd)
