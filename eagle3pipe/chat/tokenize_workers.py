"""Stage 01's conversations (and stage 05's prompts) through the chat template in worker processes
(`--num-workers`), each item's outcome yielded in the items' order, so the rows, counts and first errors are those
of one process.

Rendering and tokenizing are one CPU core's work per conversation (about 240 ShareGPT conversations a second on
SmolLM2's tokenizer here: 500k conversations take 35 minutes in one process). The workers are forked after the
tokenizer loaded, so none imports transformers or loads the tokenizer again, and they read the items from the
memory they share with the stage: only chunk bounds go out and rows come back, a bounded window of chunks ahead
of the rows the stage has taken. Linux only (fork, the parent-death signal): elsewhere one process does it all.

- The template is the operator's code, run where it can be stopped: a render past its time budget ends by its alarm
  where it runs Python code, and a worker stuck in one C call past it (a Jinja expression that builds gigabytes) is
  killed by the stage, which names the item (deadlines.Watch). So a small job runs in one worker process too; only
  --num-workers 0, or the conversations after --regenerate (whose engine shares this process) render here, with the
  alarm alone.
- A worker that dies (the kernel's OOM killer, a signal) ends the stage with one line, not a wait on a result that
  will never come (concurrent.futures reports a dead worker; multiprocessing.Pool waits forever).
- A conversation that stops the stage (a template past its time budget, an unexpected failure) ends its chunk there,
  and a stage that stops early (a refusal, Ctrl-C, SIGTERM) kills its workers at once rather than let them finish
  the chunks queued: they write nothing. A stage that dies otherwise (SIGKILL included) takes them with it (a
  parent-death signal). Workers ignore Ctrl-C and SIGHUP, which are the stage's to act on (a stage under nohup
  ignores SIGHUP, and so must they); the stop signals stay blocked from the fork until a worker has set that up.
"""
import collections
import concurrent.futures
import contextlib
import functools
import itertools
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time

from . import masks
from ..base import deadlines, devices, faults, lifeline
from ..base.errors import RunError, UsageError

AUTO_MIN_RECORDS = 1000  # below this one process is quicker than starting workers
AUTO_MAX_WORKERS = 32
CHUNK = 64               # conversations a task: enough to hide the round trip, few enough to keep the order moving
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}

_shared = {}             # what a forked worker reads: the items, the function of one item, the render watch
WAIT_SLICE = 0.5         # seconds between the stage's looks at its workers' renders


def outcome(tok, messages, max_seq_len, tools):
    """One conversation -> ("ok", ids, mask, meta) or (kind, message) for a conversation that cannot train:
    "slow" (a template past its time budget), "panic" (the tokenizer's Rust code panicked), "dropped" (a tool call
    the template does not render), "error" (the template refused it). Plain tuples: they cross a process boundary."""
    try:
        ids, mask, meta = masks.tokenize_conversation(tok, messages, max_seq_len, tools)
    except masks.TemplateTooSlow as e:
        return ("slow", str(e))
    except masks.TokenizerPanic as e:
        return ("panic", str(e))
    except masks.ToolCallsNotRendered as e:
        return ("dropped", str(e))
    except masks.TemplateError as e:
        opening = _opening_assistant(messages)
        if opening:  # an alternating template (Gemma's) refuses a conversation an assistant opens: only that turn goes
            kind, *rest = outcome(tok, messages[:opening[0]] + messages[opening[1]:], max_seq_len, tools)
            if kind == "ok":
                ids, mask, meta = rest
                return ("ok", ids, mask, {**meta, "opening_turns_dropped": opening[1] - opening[0]})
        return ("error", str(e))
    return ("ok", ids, mask, meta)


def _opening_assistant(messages):
    """(start, end) of the assistant turns that open a conversation (after its system turns; they answer nothing),
    or None."""
    start = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    end = next((i for i in range(start, len(messages)) if messages[i]["role"] != "assistant"), len(messages))
    return (start, end) if start < end < len(messages) else None


def count(requested, n_records, regenerate=False):
    """The worker processes to use (0: this process): `requested` (--num-workers) where given, else one for a small
    job (a process the stage can kill), none after --regenerate (whose engine shared this process; forking it is not
    safe) and up to AUTO_MAX_WORKERS of the cores this process may use; none off Linux (fork and the parent-death
    signal are Linux's)."""
    if sys.platform != "linux":
        return 0
    if requested is not None:
        return max(0, min(requested, n_records))
    if regenerate:
        return 0
    if n_records < AUTO_MIN_RECORDS:
        return 1
    return max(1, min(devices.cores(), AUTO_MAX_WORKERS))


def _start_worker(stage):
    # the stage acts on stop signals and ends its workers; SIGTERM stays deadly (concurrent.futures ends a broken
    # pool's workers with it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by the stage across the fork
    lifeline.parent_death_signal(signal.SIGKILL, stage)  # forked: the environment's lifeline token is not ours
    _shared["watch"].join()


def _chunk(bounds):
    start, end = bounds
    faults.kill_point("tokenize-worker")
    fn, items = _shared["fn"], _shared["items"]
    out = []
    with _stderr_less_panics():
        for i in range(start, end):
            deadlines.Watch.working_on(i)
            try:
                out.append(fn(items[i]))
            except Exception as e:  # noqa: BLE001 - raised by the stage at this item, as one process raises it
                out.append(("crash", e))
            if out[-1][0] in STOPS:
                break  # the stage stops at this item: the rest of the chunk would only delay it
    return out


STOPS = ("slow", "panic", "crash")  # the kinds that stop the stage at their item
_PANIC = re.compile(rb"^thread '[^\n]* panicked at", re.M)  # "thread '<unnamed>' (315) panicked at ..."


@contextlib.contextmanager
def _stderr_less_panics():
    """This worker's standard error held in a file for the chunk and passed on after it, less a Rust panic's report
    (its message, and a backtrace under RUST_BACKTRACE): the stage says it in one line (masks.TokenizerPanic)."""
    try:
        held = tempfile.TemporaryFile()
    except OSError:  # no writable temporary folder: Rust's report then reaches the log as it is
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with held:
            os.dup2(held.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                held.seek(0)
                text = held.read()
                panic = _PANIC.search(text)
                if panic:  # and the blank line Rust writes before it
                    text = text[:panic.start()].rstrip(b"\n") + b"\n" if text[:panic.start()].strip() else b""
                sys.stderr.buffer.write(text)  # whole, where one os.write to a pipe may write part
                sys.stderr.flush()
    finally:
        os.close(saved)


def _record(tok, max_seq_len, record):
    _, messages, tools = record
    return outcome(tok, messages, max_seq_len, tools)


def outcomes(records, tok, max_seq_len, workers):
    """Each record's outcome(), in the records' order, computed by `workers` processes (0: this one)."""
    def slow(i, seconds):
        return UsageError(f"record {records[i][0]}: {masks.too_slow(tok, seconds)}")
    return mapped(records, functools.partial(_record, tok, max_seq_len), workers, slow)


def probe(tok, records, max_seq_len):
    """The first record rendered and tokenized once, in a process the stage can kill: a template past its time budget
    or a tokenizer that panics is one line naming it and the record before the folder is taken. A template that
    refuses the record is the loop's business (counted there), not a refusal. Rendered twice: a template that
    renders the same conversation otherwise each time (a `random` filter) makes rows no later render matches."""
    seen = []
    for kind, *rest in outcomes(records[:1] * 2, tok, max_seq_len, count(1, len(records))):
        if kind in ("slow", "panic"):
            raise UsageError(f"record {records[0][0]}: {rest[0]}")
        seen.append((kind, (list(rest[0]), list(rest[1])) if kind == "ok" else None))
    if seen[0][0] == seen[1][0] == "ok" and seen[0][1] != seen[1][1]:
        where = getattr(tok, "name_or_path", "") or "the tokenizer"
        raise UsageError(f"record {records[0][0]}: the chat template of {where} renders the same conversation "
                         f"differently each time (a random choice in it): its rows would match no other render of it, "
                         f"the verifier's included; fix the template")


def mapped(items, fn, workers, slow):
    """fn(item) for each item, in order, by `workers` forked processes (0: this one). fn returns a tuple whose first
    element is its kind; those in STOPS end a worker's chunk. slow(index, seconds) -> the error for an item whose
    render a worker did not end within its budget and grace (the worker killed)."""
    if workers < 1:
        for item in items:
            yield fn(item)
        return
    lifeline.start()  # the workers die with the stage, however it ends
    watch = deadlines.Watch(workers)
    _shared.update(fn=fn, items=items, watch=watch)
    # the tokenizer's own threads are unusable after a fork: say so once here, not as a warning from every worker
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    size = max(1, min(CHUNK, len(items) // (4 * workers)))  # a small job still spreads over every worker
    chunks = ((i, min(i + size, len(items))) for i in range(0, len(items), size))
    limit, seconds = deadlines.worker_seconds(), deadlines.template_seconds()
    grace = deadlines.overdue_grace(seconds)
    before = set(multiprocessing.active_children())
    pool, finished = None, False
    try:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # until each worker has its own handling
        try:
            pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                                          initializer=_start_worker, initargs=(os.getpid(),))
            # chunks in flight, in order, at most this many ahead of the rows taken (a finished chunk waits as Python
            # lists, about 40 bytes a token); the first submit forks every worker
            window = collections.deque(pool.submit(_chunk, b) for b in itertools.islice(chunks, 2 * workers + 1))
            faults.signal_point("tokenize-start")  # a stop while the workers start (tests/reliability)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a stop signal that came meanwhile is raised here
        try:
            while window:
                results = _result(window.popleft(), limit, size, watch, grace, lambda i: slow(i, seconds))
                following = next(chunks, None)
                if following is not None:
                    window.append(pool.submit(_chunk, following))
                yield from results
            finished = True
        except concurrent.futures.process.BrokenProcessPool as e:
            raise RunError(f"a tokenizing worker process died ({e}): killed, or out of memory? No rows were "
                           f"written; rerun, with fewer --num-workers if memory is short") from None
    finally:
        _shared.clear()
        if finished:
            pool.shutdown()  # idle workers, each gone at its stop marker
        else:  # stopped early, or never started whole (a fork that failed): the workers write nothing, so they end
            # now, not after the chunks queued (or never, waiting on a queue nobody feeds)
            procs = set(multiprocessing.active_children()) - before
            for p in procs:
                p.kill()
            if pool is not None:  # its manager thread, seeing them dead, ends at once: joined here, for Python
                # 3.11's exit would otherwise race it on a pipe it closes (a traceback after the stage's error line)
                pool.shutdown(cancel_futures=True)
            for p in procs:
                p.join(10)


def _result(future, limit, size, watch, grace, slow):
    """The chunk's outcomes, looking at the workers' renders every WAIT_SLICE: one stuck past its budget and grace
    raises slow(item) (the caller kills the workers); no answer within `limit` seconds is a stuck worker."""
    until = time.monotonic() + limit
    while True:
        try:
            return future.result(timeout=WAIT_SLICE)
        except concurrent.futures.TimeoutError:
            item = watch.overdue(grace)
            if item is not None:
                raise slow(item) from None
            if time.monotonic() > until:
                raise RunError(f"a tokenizing worker returned nothing for {limit:g} s (a chunk of {size} "
                               f"conversations takes about a second): stopped or stuck; no rows were written; rerun "
                               f"(with --num-workers 0 if it recurs; EAGLE3_WORKER_TIMEOUT_S moves the limit)") from None
