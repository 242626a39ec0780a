"""Fault injection for the reliability tests: real code paths, with the fault switched on by an environment
variable. Nothing here does anything unless a variable is set.

    EAGLE3_INJECT_KILL=POINT[:N]       SIGKILL this process the Nth time (default 1st) it reaches POINT:
                                       load (stage 02, before the verifier loads), batch (a batch computed, none
                                       of it queued for writing), write (a file half written under its temporary
                                       name), between (a batch's files all written, the next not started),
                                       end (every file written, the manifest not yet); stage 04: save (a
                                       checkpoint half written in .saving/), publish (the previous checkpoint
                                       deleted, the new one not yet renamed into place), worker-probe (the
                                       probe worker stage 04 forks from its loader server, warm_start.py);
                                       stage 01: tokenize (the stage, at each conversation's outcome, its
                                       workers busy), tokenize-worker (a --num-workers process, at a chunk);
                                       any stage: installed (a finished file renamed into place, its new name
                                       not yet recorded), renamed (a folder renamed into place, its old names
                                       not yet forgotten)
    EAGLE3_INJECT_SIGNAL=POINT:SIG[:N] send SIG (TERM, INT) to this process the Nth time it reaches POINT: read
                                       (stage 04, inside a training sample's read), measure (inside the epoch's
                                       acceptance measure): a stop that lands where a broad `except` stands;
                                       tokenize (stage 01, its --num-workers busy), tokenize-start (stage 01,
                                       its workers forked, stop signals blocked until they are set up)
    EAGLE3_INJECT_DEAF=POINT[:N]       the Nth time this process reaches POINT, sit for an hour in one call that no
                                       alarm interrupts (the stop signals still end it): render (inside a chat
                                       template's time budget; what a Jinja expression building gigabytes does)
    EAGLE3_INJECT_OOM_ABOVE_TOKENS=N   raise torch's OutOfMemoryError for any stage 02 forward over N tokens
    EAGLE3_INJECT_OOM_AT_BATCH=N[:cpu] raise it at the Nth training batch of each stage 04 epoch, worded as CUDA
                                       words it (the words of a run that met three others on its card); with
                                       `:cpu`, the RuntimeError torch's CPU allocator raises instead
    EAGLE3_INJECT_NAN_ROWS=3,7         poison those rows' hidden states before stage 02's finiteness check
"""
import os
import signal
import threading
import time

_counts, _lock = {}, threading.Lock()


def armed(name):
    return os.environ.get("EAGLE3_INJECT_KILL", "").split(":")[0] == name


def _nth(key, nth):
    """Whether this is the `nth` time (default the first) this process reaches `key`."""
    with _lock:
        _counts[key] = _counts.get(key, 0) + 1
        return _counts[key] == int(nth or 1)


def kill_point(name):
    if armed(name) and _nth("kill:" + name, os.environ["EAGLE3_INJECT_KILL"].partition(":")[2]):
        os.kill(os.getpid(), signal.SIGKILL)


def signal_point(name):
    point, _, rest = os.environ.get("EAGLE3_INJECT_SIGNAL", "").partition(":")
    sig, _, nth = rest.partition(":")
    if point == name and _nth("signal:" + name, nth):
        os.kill(os.getpid(), getattr(signal, "SIG" + sig))


def deaf_point(name):
    point, _, nth = os.environ.get("EAGLE3_INJECT_DEAF", "").partition(":")
    if point == name and _nth("deaf:" + name, nth):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)


def oom_above():
    return int(os.environ.get("EAGLE3_INJECT_OOM_ABOVE_TOKENS", "0") or 0)


def oom_point(batch):
    """Stage 04's training loader, at the `batch`th batch (from 1) of an epoch."""
    at, _, where = os.environ.get("EAGLE3_INJECT_OOM_AT_BATCH", "").partition(":")
    if batch != int(at or 0):
        return
    if where == "cpu":
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 34359738368 bytes. Error code 12 (Cannot allocate memory)")
    import torch
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 79.18 GiB of which 1.57 "
        "GiB is free. Process 835 has 21.00 GiB memory in use. Including non-PyTorch memory, this process has "
        "14.55 GiB memory in use. Process 833 has 21.01 GiB memory in use. Process 832 has 21.01 GiB memory in "
        "use. Of the allocated memory 10.20 GiB is allocated by PyTorch, and 2.31 GiB is reserved by PyTorch but "
        "unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def nan_rows():
    return {int(x) for x in os.environ.get("EAGLE3_INJECT_NAN_ROWS", "").split(",") if x.strip()}
