"""The two failures a stage reports as one line, and how a line is kept one line. Imports nothing of the package,
so every module can raise them (cli.run prints them: UsageError exit 2, RunError exit 1)."""


RERUN = None  # a stage that does not resume says what its rerun does instead (stage 05)
MEMORY = None  # what bounds a stage's memory, for its out-of-memory line (stage 04: --total-seq-len)


def resume_hint():
    """How an interrupted stage resumes: the same command, less --overwrite (with it, the rerun would delete what the
    stopped run made and start over)."""
    import sys
    if RERUN:
        return RERUN
    return "rerun the same command" + (" without --overwrite" if "--overwrite" in sys.argv[1:] else "") + " to resume"


class UsageError(Exception):
    """A problem the operator fixes by changing a flag, a file or a record. Printed as one line, exit 2."""


class RunError(Exception):
    """A failure at run time that one line explains (an engine that died, say). Printed as one line, exit 1."""


def oneline(text):
    """`text` as one physical line: control characters and undecodable bytes (file names) escaped."""
    out = []
    for c in str(text):
        if ord(c) < 32 or ord(c) == 127:
            out.append(repr(c)[1:-1])  # \n, \x1b: a newline in a name never splits the line
        elif 0xDC80 <= ord(c) <= 0xDCFF:  # a byte that is not UTF-8 (a Latin-1 file name), as Python decodes it
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        else:
            out.append(c)
    return "".join(out)


def quote(path):
    """A name for a one-line message: control characters and undecodable bytes escaped."""
    import os
    return oneline(os.fsdecode(path) if isinstance(path, bytes) else path)


_SIZE = r"([\d.]+) ([KMGT]?i?B)"
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def gpu_out_of_memory(text):
    """torch's CUDA out-of-memory message, a paragraph that names every process on the card, as its figures: what
    was asked for, what was free of what, what this process and the others held. Another wording: its first 200
    characters."""
    import re
    t = " ".join(str(text).split())
    asked = re.search(r"Tried to allocate " + _SIZE, t)
    card = re.search(r"GPU (\d+) has a total capacity of " + _SIZE + r" of which " + _SIZE + r" is free", t)
    if not (asked and card):
        return f"out of GPU memory ({t[:200]})"
    line = (f"GPU {card[1]} out of memory: asked for {asked[1]} {asked[2]} with {card[4]} {card[5]} free of "
            f"{card[2]} {card[3]}")
    mine = re.search(r"this process has " + _SIZE + r" memory in use", t)
    if mine:
        line += f"; this process held {mine[1]} {mine[2]}"
    others = re.findall(r"Process (\d+) has " + _SIZE + r" memory in use", t)
    if others:  # another run on the same card is the usual cause when the stage's own checks passed
        held = sum(float(n) * _UNITS.get(u, 1) for _, n, u in others) / 2**30
        line += (f", {len(others)} other process{'es' if len(others) > 1 else ''} {held:.2f} GiB "
                 f"(pid{'s' if len(others) > 1 else ''} {', '.join(pid for pid, _, _ in others)})")
    return line
