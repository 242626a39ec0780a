"""The two failures a stage reports as one line, and how a line is kept one line. Imports nothing of the package,
so every module can raise them (cli.run prints them: UsageError exit 2, RunError exit 1)."""

import os
import re
import sys

from . import devices


RERUN = None  # a stage that does not resume says what its rerun does instead (stage 05)
MEMORY = {}  # what else an out-of-memory line advises, by what ran out ("gpu", "host"): stage 04's --total-seq-len


def resume_hint():
    """How an interrupted stage resumes: the same command, less --overwrite (with it, the rerun would delete what the
    stopped run made and start over)."""
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
    return oneline(os.fsdecode(path) if isinstance(path, bytes) else path)


_SIZE = r"([\d.]+) ((?:[KMGT]i)?B|bytes)"  # torch's own sizes: "0 bytes", "20.00 MiB", "79.18 GiB"
_UNITS = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _bytes(number, unit):
    return float(number) * _UNITS[unit]


def gpu_out_of_memory(text, visible=None):
    """torch's CUDA out-of-memory message, a paragraph that names every process on the card, as its figures: what
    was asked for, what was free of what, what this process and the others held. `visible`: CUDA_VISIBLE_DEVICES
    (torch's GPU numbers count only those; nvidia-smi's are the machine's). Another wording: its first 200
    characters."""
    t = " ".join(str(text).split())
    asked = re.search(r"Tried to allocate " + _SIZE, t)
    card = re.search(r"GPU (\d+) has a total capacity of " + _SIZE + r" of which " + _SIZE + r" is free", t)
    if not (asked and card):
        return f"out of GPU memory ({t[:200]})"
    index, total = card[1], _bytes(card[2], card[3])
    shown = [x.strip() for x in ((devices.visible_setting() or "") if visible is None else visible).split(",")]
    physical = shown[int(index)] if all(x.isdigit() for x in shown) and int(index) < len(shown) else index
    line = (f"GPU {index}{f' (nvidia-smi GPU {physical})' if physical != index else ''} out of memory: asked for "
            f"{asked[1]} {asked[2]} with {card[4]} {card[5]} free of {card[2]} {card[3]}")
    mine = re.search(r"this process has " + _SIZE + r" memory in use", t)
    # a driver that cannot tell a process's memory (a container, MIG) reports 16 EiB-scale figures: not figures
    if mine:
        line += (f"; this process held {mine[1]} {mine[2]}" if _bytes(mine[1], mine[2]) <= total else
                 "; the driver did not report this process's share")
    listed = re.findall(r"Process (\d+) has " + _SIZE + r" memory in use", t)
    held = [(pid, _bytes(n, u)) for pid, n, u in listed if _bytes(n, u) <= total]
    if held:  # without "this process has" (another PID namespace) the run's own process is among them
        who = "other process" if mine else "process"
        line += (f"{',' if mine else ';'} {len(held)} {who}{'es' if len(held) > 1 else ''}{'' if mine else ' held'} "
                 f"{sum(b for _, b in held) / 2**30:.2f} GiB (pid{'s' if len(held) > 1 else ''} "
                 f"{', '.join(pid for pid, _ in held)})")
    return line


def host_out_of_memory(text):
    """An allocation the machine's RAM refused: torch's CPU allocator says how much it asked for."""
    asked = re.search(r"tried to allocate (\d+) bytes", str(text))
    return f"out of memory{f' (RAM: asked for {int(asked[1]) / 2**30:.2f} GiB)' if asked else ''}"
