"""An engine's log: where everything it prints goes, and the one line that names why it failed.

- `engine_output(log_path)`: while inside, this process's stdout and stderr go to the log (vLLM, Triton and torch
  print there, and the processes started meanwhile keep it as their output for good).
- `root_cause(lines)` / `last_error(log_path)`: the exception that names a cause. A library failing inside a child
  process prints a chain of tracebacks, the cause first and then each process's wrapper ("WorkerProc initialization
  failed due to an exception in a background process. See stack trace for root cause.", "Engine core initialization
  failed. See root cause above."): the wrappers are skipped, whatever process printed them. Pure text: no import
  beyond the standard library (cli.describe uses it too).
"""
import contextlib
import logging
import os
import re
import sys
import time
from ..storage import outdir

# a process tag vLLM puts before each line of a child's output: "(EngineCore_DP0 pid=123) ", "(Worker_TP1 pid=9) "
_TAG = re.compile(r"^\((?P<tag>[\w.\-]+(?: rank=\d+)? pid=\d+)\)\s?")
# a logger's prefix: vLLM's "ERROR 01-02 10:11:12 [core.py:708] ", Python's "2024-01-02 10:11:12,345 ERROR ",
# "[rank0]: "
_LEVEL = re.compile(r"^(?:\[rank\d+\]:\s?)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?"
                    r"\s+\[[^\]]*\]\s?|\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?\s+(?:DEBUG|INFO|WARNING|ERROR|"
                    r"CRITICAL)\s+)")
_EXC = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure|Fault)(?::\s?.*)?$"
                  r"|^(?:[a-z_][\w]*\.)+[A-Z]\w*(?::\s?.*)?$|^Exception(?::\s?.*)?$")
_CHAIN = ("The above exception was the direct cause of the following exception:",
          "During handling of the above exception, another exception occurred:")
# an exception or log line that only says a cause is elsewhere (a process failed, see above / the log)
WRAPPER = re.compile(
    r"see (?:the )?(?:stack ?trace|root cause|above|log|logs|error above|traceback)|initiali[sz]ation failed|"
    r"failed to start|EngineDeadError|EngineGenerateError|background process|Failed core proc|died unexpectedly|"
    r"(?:WorkerProc|EngineCore|worker) (?:\w+ )?failed|BrokenProcessPool|ChildFailedError|"
    r"^(?:[\w.]+\.)?(?:SystemExit|KeyboardInterrupt)\b|exited with (?:exit )?code|Engine process failed|"
    r"Original Traceback|^[\w.]+Error$", re.I)


def _strip(line):
    """(process tag, the line without its tag and logger prefix)."""
    m = _TAG.match(line)
    tag = m.group("tag").split(" pid=")[0] if m else ""
    rest = line[m.end():] if m else line
    rest = _LEVEL.sub("", rest, count=1)
    return tag, rest.rstrip()


def _episode(lines):
    """The lines of the last run in a log that several runs appended to (make_llm writes `==== `, Server.start
    `# <date>` before each)."""
    for k in range(len(lines) - 1, -1, -1):
        if lines[k].startswith("==== ") or re.match(r"^# \d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", lines[k]):
            return lines[k + 1:]
    return lines


def exceptions(lines):
    """[(chain number, exception line)] of the tracebacks in `lines`, in the order their exceptions were printed;
    the tracebacks of a chain ("The above exception was the direct cause ...") share their number. Each process's
    lines (vLLM's `(Tag pid=N)` prefix) are read apart, so interleaved output does not break a traceback."""
    state, found, chains = {}, [], 0
    for line in lines:
        tag, text = _strip(line)
        st = state.setdefault(tag, {"in_tb": False, "frames": 0, "chain": None, "linked": False, "more": None})
        if st["more"] is not None:  # an exception whose message ends "Reasons:": its reasons are the next lines
            k, left = st["more"]
            if text.strip() and not text.rstrip().endswith("Traceback (most recent call last):") and left:
                found[k] = (found[k][0], found[k][1] + " " + " ".join(text.split()))
                st["more"] = (k, left - 1) if left > 1 else None
                continue
            st["more"] = None
        if text.rstrip().endswith("Traceback (most recent call last):"):  # "Original Traceback ...": a worker's
            if not st["linked"]:
                chains += 1
                st["chain"] = chains
            st.update(in_tb=True, frames=0, linked=False)
            continue
        if text.strip() in _CHAIN:
            st["linked"] = True
            continue
        if not st["in_tb"]:
            continue
        if text.startswith((" ", "\t")) or not text.strip():
            st["frames"] += 1
            continue
        st["in_tb"] = False
        if _EXC.match(text.strip()):
            found.append((st["chain"], " ".join(text.split())))
            if text.rstrip().endswith(":"):
                st["more"] = (len(found) - 1, 3)
    return found


def root_cause(lines):
    """The line that names why a run failed, from its log's lines: in the last chain of tracebacks whose
    exceptions are not all wrappers, the first exception that is not one (the cause; the chain's later ones wrap
    it); without tracebacks, the last ERROR line that is not a wrapper; '' if none."""
    lines = _episode(list(lines))
    found = exceptions(lines)
    for chain in sorted({c for c, _ in found}, key=lambda c: max(k for k, (c2, _) in enumerate(found) if c2 == c),
                        reverse=True):
        causes = [text for c, text in found if c == chain and not WRAPPER.search(text)]
        if causes:
            return causes[0][:300]
    hits = [_strip(l)[1] for l in lines if "ERROR" in l or "Error:" in l or "Exception:" in l]
    hits = [h for h in hits if h.strip() and not h.startswith((" ", "\t", "Traceback (most recent call last)"))]
    named = [h for h in hits if not WRAPPER.search(h)]
    pick = named[-1] if named else (found[-1][1] if found else (hits[-1] if hits else ""))
    return " ".join(pick.split())[:300]


def last_error(log_path, tail=262144):
    """root_cause of the end of `log_path`; '' if it cannot be read or names nothing."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - tail))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return root_cause(lines)


def open_log(log_path):
    """A file descriptor appending to `log_path`, never through a link planted there (outdir.open_append); RunError
    (one line) if it cannot be opened."""
    return outdir.open_append(log_path, children_write=True)


@contextlib.contextmanager
def engine_output(log_path):
    """While inside, this process's stdout and stderr (file descriptors 1 and 2) go to `log_path`, so everything
    vLLM, Triton and torch print while the engine starts lands there, and the worker processes started meanwhile
    keep the file as their output for good. vLLM's own logger in this process is pointed at the file too. The
    file is opened without following a link (O_NOFOLLOW): a link planted there is refused, never written through."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = open_log(log_path)
    saved = os.dup(1), os.dup(2)
    try:
        os.write(fd, f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {' '.join(sys.argv)}\n".encode())
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield saved[1]  # the stage's own stderr, for a line the operator must see meanwhile
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (*saved, fd):
            os.close(f)
        stream = None
        for h in logging.getLogger("vllm").handlers:  # vLLM's later messages in this process: to the file too
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                stream = stream or os.fdopen(open_log(log_path), "a", encoding="utf-8")
                h.setStream(stream)
