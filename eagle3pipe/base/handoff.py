"""What the launcher (launch.py, scripts/extract.sh) hands the stage it starts, as inherited file descriptors named
in the environment:
- the output folder's locks, which the launcher took before starting the stage: no other run can take the folder
  between the launcher's checks and the stage's own claim, so of two launches at the same moment exactly one starts;
- a pipe the stage writes to, then closes, once it has claimed the folder: the launcher's sign that its child runs.
A descriptor is used only if it is what the variable says (its device and inode), so a variable that leaked into
another process's environment does nothing there. Imports nothing of the package (outdir.py imports this).
"""
import fcntl
import os
import stat

LOCKS = "EAGLE3_HANDED_LOCKS"  # "<fd>:<device>:<inode>,..." of lock files the launcher holds for the stage
READY = "EAGLE3_READY_PIPE"  # "<fd>:<device>:<inode>" of a pipe's write end


def describe(fds):
    return ",".join(f"{fd}:{os.fstat(fd).st_dev}:{os.fstat(fd).st_ino}" for fd in fds)


def _take(name, fifo):
    """The descriptors the variable `name` names that are what it says; the variable is dropped either way, so the
    stage's own children (engines, workers) never see it."""
    fds = []
    for item in os.environ.pop(name, "").split(","):
        try:
            fd, dev, ino = (int(x) for x in item.split(":"))
            st = os.fstat(fd)
        except (ValueError, OSError):
            continue
        if (st.st_dev, st.st_ino) == (dev, ino) and stat.S_ISFIFO(st.st_mode) == fifo:
            os.set_inheritable(fd, False)  # closed across exec: an engine the stage starts does not hold them
            fds.append(fd)
    return fds


_locks = _take(LOCKS, fifo=False)
_ready = _take(READY, fifo=True)


def handed():
    """Whether a launcher handed this process the locks of its folder (it also compacted the folder's record)."""
    return bool(_locks)


def lock_for(fd, mode):
    """A new descriptor of the lock the launcher holds for this process on the file `fd` is open on, or None. The lock
    belongs to the launcher's open file, which this process shares: no second lock is taken (it would conflict).
    That it does hold `mode` is asked of the kernel (a lock an open file already holds is granted again at once): a
    variable naming a descriptor of the right file that holds no lock (set by hand, with another run holding the
    folder) is refused by the other run's lock, not trusted. `mode` must be the one the launcher took (both come from
    locks.lock_names): flock on an open file that holds the other mode converts it, for the launcher too."""
    st = os.fstat(fd)
    for held in _locks:
        h = os.fstat(held)
        if (h.st_dev, h.st_ino) == (st.st_dev, st.st_ino):
            try:
                fcntl.flock(held, mode | fcntl.LOCK_NB)
            except OSError:
                return None
            return os.dup(held)
    return None


def ready():
    """Tell the launcher the folder is claimed: one byte, then the pipe closed (a stage that dies first only closes
    it, which the launcher reads as 'stopped')."""
    while _ready:
        fd = _ready.pop()
        try:
            os.write(fd, b"1")
        except OSError:
            pass  # the launcher is gone: nobody waits
        os.close(fd)


def env_for(locks, pipe):
    """The environment entries that hand `locks` (descriptors) and the write end `pipe` to a child; pass the same
    descriptors as Popen's pass_fds."""
    return {LOCKS: describe(locks), READY: describe([pipe])}
