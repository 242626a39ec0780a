"""What a stage inherits from the shell that starts it: its standard streams, its umask, the cache folders torch is
pointed at, the KV cache vLLM-CPU is told to reserve. The streams are made safe before anything else runs (cli.run,
`guard`); the rest is checked with the flags (cli.parse_args, `check`), one line and exit 2 before anything is read
or made.

- A stage started with a standard file descriptor closed (`>&-`, `2>&-`, `<&-`, a supervisor that closes them) would
  hand that number to the first file it opens: the folder's lock or ownership record would become fd 1, and any
  line printed (by this process or a child that inherits it) would land in the record. A closed 0, 1 or 2 is
  reopened on /dev/null first, and Python's `None` for it becomes a real stream.
- Output that cannot be written (`| head -1` after its first line, a redirect to a full disk, a `tee` killed with
  the operator's ssh session) must not fail a stage that did its work, nor turn a refusal into a traceback with the
  wrong exit code: the line is dropped, the stream goes to /dev/null from then on, and the stage goes on.
"""
import os
import sys

from .. import REPO
from .errors import UsageError

# folders torch and Triton create when first imported (a file there failed as FileExistsError from inside torch)
CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
KV_CACHE_VARIABLE = "VLLM_CPU_KVCACHE_SPACE"  # GiB; where set, vLLM-CPU takes it over the engine's own argument


def check():
    """The umask and the cache variables, refused in one line when a stage could not work under them."""
    mask = _umask()
    if mask & 0o700:
        # the stage's own folder came out unwritable, and the lock in it was then blamed on a link
        raise UsageError(f"umask {mask:04o} takes the owner's own permissions away from every file and folder a stage "
                         f"makes (it could not write its own lock); set umask 022 (or 077), then rerun")
    for name in CACHE_VARIABLES:
        path = os.environ.get(name)
        if path and os.path.lexists(path) and not os.path.isdir(path):  # a file, or a link to nothing
            raise UsageError(f"{name}={path}: not a folder (torch makes its cache there); unset it or name a folder, "
                             f"then rerun")
    kv = os.environ.get(KV_CACHE_VARIABLE, "")
    if kv != "" and kv_cache_gib() is None:  # vLLM-CPU reads it with int() as its engine starts, minutes in
        raise UsageError(f"{KV_CACHE_VARIABLE}={kv!r}: not a whole number of GiB (vLLM-CPU's KV cache); unset it to "
                         f"let each engine take what it needs, or give e.g. 2, then rerun")


def kv_cache_gib():
    """VLLM_CPU_KVCACHE_SPACE as vLLM-CPU reads it (a whole number of GiB, where set and not empty), if it is one of at
    least 1; None otherwise."""
    try:
        n = int(os.environ.get(KV_CACHE_VARIABLE, ""))
    except ValueError:
        return None
    return n if n >= 1 else None


def _umask():
    """The process's umask, read where Linux shows it (setting it to read it back would race the stage's threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def guard():
    """Fds 0-2 open, and sys.stdout / sys.stderr streams whose writes never raise (see the module's docstring)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:  # os.open takes the lowest free number: the closed one, unless a lower one was closed too
                os.dup2(null, fd)
                os.close(null)
    sys.stdout = _quiet(sys.stdout, 1)
    sys.stderr = _quiet(sys.stderr, 2)


def _quiet(stream, fd):
    if isinstance(stream, Quiet):
        return stream
    if stream is None:  # Python's stand-in for a descriptor closed at its start
        stream = open(fd, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    elif hasattr(stream, "reconfigure"):  # a path the terminal's encoding lacks (LC_ALL=C) is escaped, not an error
        stream.reconfigure(errors="backslashreplace")
    return Quiet(stream)


def last_words(fd, text):
    """One line written straight to a descriptor just before os._exit (a signal handler, a watchdog thread): a reader
    gone (a killed `tee`, a closed ssh session) must not stop the exit that follows."""
    try:
        os.write(fd, text.encode("utf-8", "replace"))
    except OSError:
        pass


def child_pythonpath(current):
    """PYTHONPATH for a child that imports this package (an engine, its workers, a server): the package's root first,
    then the current value's entries that are not empty (an empty entry means the child's current folder, searched
    before the standard library: a json.py where the operator stands would run in the engine)."""
    rest = [p for p in (current or "").split(os.pathsep) if p and p != REPO]
    return os.pathsep.join([REPO] + rest)


class Quiet:
    """A text stream that drops what it cannot write instead of raising; every other attribute is the stream's."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        written = self._unless_gone(self._stream.write, text)
        return len(text) if written is None else written

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        self._unless_gone(self._stream.flush)

    def _unless_gone(self, op, *args):
        """op(*args), or None where the output cannot be written (then silenced) or the stream is closed."""
        try:
            return op(*args)
        except BlockingIOError:  # a non-blocking terminal that is full for now: not a reader gone
            raise
        except OSError:
            self._silence()
        except ValueError:
            if not self._stream.closed:
                raise
        return None

    def _silence(self):
        """Its file descriptor onto /dev/null: what is still buffered, and Python's flush at exit, then succeed."""
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)
