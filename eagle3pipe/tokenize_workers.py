"""Stage 01's conversations through the chat template in worker processes (`--num-workers`), each conversation's
outcome yielded in the records' order, so the rows, counts and first errors are those of one process.

Rendering and tokenizing are one CPU core's work per conversation (about 240 ShareGPT conversations a second on
SmolLM2's tokenizer here: 500k conversations take 35 minutes in one process). The workers are forked after the
tokenizer loaded, so none imports transformers or loads the tokenizer again, and they read the records from the
memory they share with the stage: only chunk bounds go out and rows come back. Fork only (Linux): where it is not
the platform's way, one process does it all.

- A worker that dies (the kernel's OOM killer, a signal) ends the stage with one line, not a wait on a result that
  will never come (concurrent.futures reports a dead worker; multiprocessing.Pool waits forever).
- Workers take no stop signal of their own: Ctrl-C or SIGTERM stops the stage, whose exit ends them; a stage
  that dies otherwise (SIGKILL included) takes them with it (a parent-death signal; the lifeline for the rest).
"""
import concurrent.futures
import multiprocessing
import os
import signal

from . import faults, lifeline
from .errors import RunError

AUTO_MIN_RECORDS = 1000  # below this one process is quicker than starting workers
AUTO_MAX_WORKERS = 32
CHUNK = 64               # conversations a task: enough to hide the round trip, few enough to keep the order moving

_shared = {}             # what a forked worker reads: the records, the tokenizer, --max-seq-len


def outcome(tok, messages, max_seq_len, tools):
    """One conversation -> ("ok", ids, mask, meta) or (kind, message) for a conversation that cannot train:
    "slow" (a template past its time budget), "dropped" (a tool call the template does not render), "error" (the
    template refused it). Plain tuples: they cross a process boundary."""
    from . import masks
    try:
        ids, mask, meta = masks.tokenize_conversation(tok, messages, max_seq_len, tools)
    except masks.TemplateTooSlow as e:
        return ("slow", str(e))
    except masks.ToolCallsNotRendered as e:
        return ("dropped", str(e))
    except masks.TemplateError as e:
        return ("error", str(e))
    return ("ok", ids, mask, meta)


def count(requested, n_records, regenerate=False):
    """The worker processes to use: `requested` (--num-workers) where given, else one for a small job (or after
    --regenerate, whose engine shared this process) and up to AUTO_MAX_WORKERS of the cores this process may use;
    one wherever fork is not available."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    if requested is not None:
        return max(1, min(requested, n_records))
    if regenerate or n_records < AUTO_MIN_RECORDS:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), AUTO_MAX_WORKERS))


def _start_worker(stage):
    # a stop signal is the stage's to handle (its handler, inherited across the fork, would raise in here)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    lifeline.parent_death_signal(signal.SIGKILL, stage)  # forked: the environment's lifeline token is not ours


def _chunk(bounds):
    start, end = bounds
    faults.kill_point("tokenize-worker")
    tok, max_seq_len, records = _shared["tok"], _shared["max_seq_len"], _shared["records"]
    return [outcome(tok, messages, max_seq_len, tools) for _, messages, tools in records[start:end]]


def outcomes(records, tok, max_seq_len, workers):
    """Each record's outcome(), in the records' order, computed by `workers` processes (1: this one)."""
    if workers <= 1:
        for _, messages, tools in records:
            yield outcome(tok, messages, max_seq_len, tools)
        return
    lifeline.start()  # the workers die with the stage, however it ends
    _shared.update(tok=tok, max_seq_len=max_seq_len, records=records)
    # the tokenizer's own threads are unusable after a fork: say so once here, not as a warning from every worker
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                                  initializer=_start_worker, initargs=(os.getpid(),))
    try:
        size = max(1, min(CHUNK, len(records) // (4 * workers)))  # a small job still spreads over every worker
        bounds = [(i, min(i + size, len(records))) for i in range(0, len(records), size)]
        try:
            for results in pool.map(_chunk, bounds):
                yield from results
        except concurrent.futures.process.BrokenProcessPool as e:
            raise RunError(f"a tokenizing worker process died ({e}): killed, or out of memory? Nothing was "
                           f"written; rerun, with fewer --num-workers if memory is short") from None
    finally:
        _shared.clear()
        pool.shutdown(wait=False, cancel_futures=True)
