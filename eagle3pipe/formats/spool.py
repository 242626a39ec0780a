"""Which files in an engine's spool are the engine's, made for this run: the only ones a stage deletes there.

An engine (vLLM's connector, ours, hf_server.py) writes each prompt's states to a file in a spool folder and names
it in its answer; the stage reads it and deletes it. The record (outdir.py) cannot list these files: another
process made them. So a file is deleted only if everything about it says it is such a file:
- a plain file with one link, in the engine's format: a safetensors header holding exactly `hidden_states` and
  `token_ids` (a person's weights, notes or archive of any name are not);
- its lock: an empty plain file `<file>.lock` beside such a file (the connector's; a lock beside a person's file,
  or beside nothing in a shared folder, stays);
- in a spool the stage does not own (`foreign`: an `--engine-spool` shared with an engine at --engine-address and
  with people), also made after this process started (its status change time, which no tool sets back, with `SKEW`
  seconds for a file server's clock): a file that was there before the run, whatever its name or format, is never
  this run's.
Nothing here deletes but remove_spool_file, by these rules (clear_spool empties a spool through it); the stage waits
for an engine's file with wait_for_engine_file.
"""
import fcntl
import logging
import os
import stat
import time

from ..base.errors import RunError
from ..storage import outdir
from .hidden_states import read_header

log = logging.getLogger("eagle3")

SKEW = 1.0  # seconds a shared filesystem's clock may lag this machine's (NTP keeps them far closer); a file kept
            # for its age is named in a warning (it is left, never lost)
_start = []
_warned = []


def process_start():
    """When this process started (seconds since the epoch); a spawned data-loader worker has its own, later one,
    which only narrows what it may delete (the files it asks for are made after it started)."""
    if not _start:
        t = None
        try:
            with open("/proc/self/stat", "rb") as f:
                ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
            with open("/proc/uptime") as f:
                uptime = float(f.read().split()[0])
            t = time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))  # to 10 ms (btime is whole seconds)
        except (OSError, ValueError, IndexError):
            pass
        _start.append(t if t is not None else time.time())
    return _start[0]


def _plain(path, foreign, st=None):
    try:
        st = st or os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return None
    if foreign and st.st_ctime < process_start() - SKEW:
        return None
    return st


def engine_made(path, foreign=False):
    """True if `path` is an engine's finished file as above (`foreign`: in a spool the stage does not own)."""
    if not path.endswith(".safetensors") or _plain(path, False) is None:
        return False
    try:
        fmt = set(read_header(path)[0]) - {"__metadata__"} == {"hidden_states", "token_ids"}
    except (OSError, ValueError, TypeError, AttributeError):
        return False
    if fmt and foreign and _plain(path, True) is None:
        if not _warned:
            _warned.append(path)
            logging.getLogger("eagle3").warning(
                f"{path}: an engine named this file, which was there before this run (or its file server's clock "
                f"lags this machine's by more than {SKEW:.0f} s): it stays, as does every such file in that spool")
        return False
    return fmt


def engine_lock(lock, foreign=False, beside_nothing=False):
    """True if `lock` is the connector's lock of an engine's file: empty, plain, named `<file>.lock`, beside that
    engine's file (or, with `beside_nothing`, in a spool the stage owns, beside nothing: the file never came)."""
    if not lock.endswith(".safetensors.lock"):
        return False
    st = _plain(lock, foreign)
    if st is None or st.st_size:
        return False
    path = lock[:-len(".lock")]
    if os.path.lexists(path):
        return engine_made(path, foreign)
    return beside_nothing and not foreign


def remove_spool_file(spool, path):
    """Delete a file an engine wrote into our spool (it is not in the record: another process made it), and its
    `.lock`; a path outside the spool is never touched. In a spool the stage does not own (an --engine-spool shared
    with people), only an engine's file made for this run (eagle3pipe/formats/spool.py: its format and age) and its lock.
    -> True if `path` was the engine's to hand back."""
    ok = outdir.confined(spool, path)
    if not ok or not os.path.lexists(ok):
        return bool(ok)
    if outdir.owned(spool):  # the folder this stage made for its engine: what the engine handed back, and its lock
        lock = outdir.confined(spool, ok + ".lock")
    elif engine_made(ok, foreign=True):
        lock = ok + ".lock" if outdir.confined(spool, ok + ".lock") and engine_lock(ok + ".lock", foreign=True) else None
    else:
        return True
    os.unlink(ok)
    if lock and os.path.lexists(lock):
        os.unlink(lock)
    return True


def wait_for_engine_file(path, spool, timeout=600):
    """Return True once the engine's writer thread has finished `path` (it holds `path`.lock until then, and a dead
    engine's lock is released with it), or False at once if `path` is not a file inside `spool`: nothing outside it
    is read, waited on or deleted. The lock is then deleted if it is the engine's (spool.py): in a spool the stage
    does not own, a lock beside anything but this run's engine file stays."""
    if spool is None or not outdir.confined(spool, path):
        return False
    lock = path + ".lock"
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        deadline = time.time() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() > deadline:
                    raise RunError(f"{outdir.quote(path)}: the engine did not finish writing it in {timeout} s")
                time.sleep(0.01)
    finally:
        os.close(fd)
    if outdir.confined(spool, lock) and engine_lock(lock, foreign=not outdir.owned(spool)):
        os.unlink(lock)
    return True


def engine_file(path):
    """True if `path` is a regular file in the engine's own format: safetensors holding exactly `hidden_states` and
    `token_ids` (what vLLM's connector, ours and hf_server.py write), or an empty `.safetensors.lock` beside one
    (or beside nothing)."""
    if path.endswith(".safetensors.lock"):
        return engine_lock(path, beside_nothing=True)
    return engine_made(path)


def clear_spool(spool):
    """In a spool folder this stage made for an engine it ran (a process since gone): delete what that engine wrote
    there, told by its format (engine_file), never by name alone; anything else, a file it was cutting short
    included, stays and is named. A folder the stage does not own (a shared --engine-spool) is never cleared: there
    only the files the engine handed back to this run are deleted, one by one. -> the entries left."""
    if not outdir.owned(spool):
        return sorted(os.listdir(spool)) if os.path.isdir(spool) else []
    for name in sorted(os.listdir(spool), key=lambda n: n.endswith(".lock")):  # files first, then their locks
        path = os.path.join(spool, name)
        if engine_file(path):
            remove_spool_file(spool, path)
    left = sorted(os.listdir(spool))
    if left:
        log.warning(f"{outdir.quote(spool)}: kept {len(left)} entries that are not an engine's finished files "
                    f"(e.g. {outdir.quote(left[0])}); delete them once checked")
    return left
