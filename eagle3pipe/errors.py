"""The two failures a stage reports as one line, and how a line is kept one line. Imports nothing of the package,
so every module can raise them (cli.run prints them: UsageError exit 2, RunError exit 1)."""


RERUN = None  # a stage that does not resume says what its rerun does instead (stage 05)


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
