"""Stage 02's run loop, shared by the vLLM and HF backends.

- Resume: a row whose file exists and validates is skipped; the rest are batched, longest first, so the
  worst-case batch runs in the first minute rather than after hours.
- OOM never kills the run: a batch that raises the framework's out-of-memory error is split in half and
  retried, down to one sample; a sample that cannot fit alone is recorded as failed. The model stays loaded.
- A background writer validates (finite values, token ids) and writes each file atomically, overlapping the
  writes with the next batch's compute. A non-finite sample is recorded as failed, never written.
- Fault injection for the tests of the real loop (kills, OOM, NaN): see faults.py.
"""
import errno
import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..base import faults
from ..base.errors import UsageError, resume_hint
from ..engines import engines
from ..formats.spool import remove_spool_file, wait_for_engine_file
from ..storage import outdir
from ..storage.rows import same_ids
from ..formats.hidden_states import (SCALES, check_file, check_header, finite, hs_path, load_checked, quantize_fp8,
                                     read_header, save, scale_note, bytes_per_token)
from ..storage.input_watch import stage01

log = logging.getLogger("eagle3")
NON_FINITE = "non-finite values"
FIRST_ROWS = 8  # a verifier whose states are not finite on each of its first rows is broken, not its rows


def make_batches(todo, lengths, batch_size, max_tokens=None):
    """Rows sorted longest first, cut into batches of <= batch_size rows and (if given) <= max_tokens."""
    order = sorted(todo, key=lambda i: (-lengths[i], i))
    batches, cur, cur_tok = [], [], 0
    for i in order:
        if cur and (len(cur) >= batch_size or (max_tokens and cur_tok + lengths[i] > max_tokens)):
            batches.append(cur)
            cur, cur_tok = [], 0
        cur.append(i)
        cur_tok += lengths[i]
    if cur:
        batches.append(cur)
    return batches


def check_all(out_dir, rows, indices, n_states, hidden, workers=None):
    """{row: None if its file is complete and right (checksum, token ids, finite values), else the reason}."""
    workers = workers or min(16, (os.cpu_count() or 1) * 2)  # reads and CRCs release the GIL
    with ThreadPoolExecutor(workers) as ex:
        return dict(zip(indices, ex.map(lambda i: check_file(hs_path(out_dir, i), rows[i], n_states, hidden), indices)))


def scan_existing(out_dir, rows, n_states, hidden, indices=None):
    """Rows (of `indices`, default all) whose file is valid; invalid files are removed (they will be redone). A killed
    writer's temporary files were removed when the folder was claimed (outdir.claim: recorded ones of dead writers)."""
    names = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    indices = range(len(rows)) if indices is None else indices
    cand = [i for i in indices if os.path.basename(hs_path(out_dir, i)) in names]
    ok = set()
    for i, reason in check_all(out_dir, rows, cand, n_states, hidden).items():
        if reason:
            log.warning(f"hs_{i}.safetensors: {reason}; it will be extracted again")
            if outdir.remove(hs_path(out_dir, i)):
                raise UsageError(f"{hs_path(out_dir, i)}: {reason}, and not the file this stage wrote; move it away")
        else:
            ok.add(i)
    return ok


def _is_oom(e):
    import torch
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


class Writer:
    """Validates and writes results on background threads; a bounded queue applies back-pressure.

    A result is either a path the engine wrote (vLLM: wait for its lock; a file of our CPU connector is checked from
    its header and token ids and renamed; any other is read, validated and rewritten with a checksum, in fp8 if
    asked) or a Pending (HF: host tensors whose device-to-host copy completes at `event`)."""

    def __init__(self, out_dir, rows, n_states, hidden, on_done, storage="bf16", threads=1, depth=8, nan_rows=(),
                 background=False, spool=None):
        self.q = queue.Queue(maxsize=depth)
        self.out_dir, self.rows, self.n_states, self.hidden, self.on_done = out_dir, rows, n_states, hidden, on_done
        self.storage, self.nan_rows, self.error, self.closed = storage, set(nan_rows), None, False
        self.background, self.spool = background, spool  # engine files are used only inside `spool`
        self.threads = [threading.Thread(target=self._loop, daemon=True, name=f"hs-writer-{k}") for k in range(threads)]
        for t in self.threads:
            t.start()

    def _adopt(self, i, path):
        """A file our CPU connector wrote (CRC and finiteness in its header): check the header and token ids, then
        rename it into place; -> (True, reason or None). (False, None) for any other file: read and rewrite it."""
        if not wait_for_engine_file(path, self.spool):
            return True, f"the engine named {outdir.quote(path)}, outside this run's spool; nothing was read or deleted"
        try:
            header = read_header(path)[0].get("__metadata__") or {}
        except (OSError, ValueError):
            return False, None  # the full path below names what is wrong with it
        if "crc32" not in header or "finite" not in header or self.storage != "bf16" or i in self.nan_rows:
            return False, None
        reason = check_header(path, len(self.rows[i]), self.n_states, self.hidden)
        if reason is None and header["finite"] != "1":
            reason = NON_FINITE
        if reason is None:
            from safetensors import safe_open
            with safe_open(path, "pt") as f:
                if not same_ids(f.get_tensor("token_ids"), self.rows[i]):
                    reason = "token_ids differ from the prepared row"
        if reason:
            remove_spool_file(self.spool, path)
        else:
            outdir.install(path, hs_path(self.out_dir, i))
        return True, reason

    def _tensors(self, i, result):
        """-> ({name: CPU tensor} to save, None) or (None, the reason the sample is bad)."""
        import torch
        if isinstance(result, str):
            reason, tensors = load_engine_file(result, self.rows[i], self.n_states, self.hidden, self.spool)
            remove_spool_file(self.spool, result)
            if reason:
                return None, reason
            if i in self.nan_rows:  # fault injection: poison the states the real check below sees
                tensors["hidden_states"] = tensors["hidden_states"].clone()
                tensors["hidden_states"].view(-1)[0] = float("nan")
            bad = not finite(tensors["hidden_states"])
        else:
            if result.event is not None:
                result.event.synchronize()  # this sample's device-to-host copy is complete
            tensors, bad = dict(result.tensors), bool(result.bad)  # checked on the device
        if bad:
            return None, NON_FINITE
        if self.storage == "fp8" and SCALES not in tensors:
            tensors["hidden_states"], tensors[SCALES] = quantize_fp8(tensors["hidden_states"])
        tensors["token_ids"] = torch.as_tensor(self.rows[i], dtype=torch.int64)
        return tensors, None

    def _loop(self):
        if self.background:  # CPU: the engine's OpenMP threads own the cores; a preempted one stalls the whole step
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        while True:
            item = self.q.get()
            if item is None:
                return
            i, result = item
            try:
                adopted, reason = self._adopt(i, result) if isinstance(result, str) else (False, None)
                if not adopted:
                    tensors, reason = self._tensors(i, result)
                    if tensors is not None:
                        save(hs_path(self.out_dir, i), tensors, **scale_note(tensors))
                self.on_done(i, reason)
            except Exception as e:  # a full disk, a dead filesystem: stop the run, do not skip samples
                self.error = self.error or e
                while True:  # keep draining so the producer never blocks on a dead writer
                    self.q.task_done()
                    if self.q.get() is None:
                        return
            self.q.task_done()

    def put(self, i, result):
        if self.error:
            raise self.error
        self.q.put((i, result))

    def close(self, raise_error=True):
        if not self.closed:
            self.closed = True
            for _ in self.threads:
                self.q.put(None)
            for t in self.threads:
                t.join()
        if self.error and raise_error:
            raise self.error


def load_engine_file(path, token_ids, n_states, hidden, spool):
    """A file vLLM's connector wrote into `spool`: wait until it is complete, then -> (reason or None, tensors)."""
    if not wait_for_engine_file(path, spool):
        return f"the engine named {outdir.quote(path)}, outside this run's spool; nothing was read or deleted", None
    reason, tensors = load_checked(path, token_ids, n_states, hidden)
    return reason, tensors and {"hidden_states": tensors["hidden_states"]}


def run(backend, rows, todo, out_dir, args, plan, progress):
    """Extract every row in `todo` (`args`: settings.Extract; `plan`: preflight.Plan). Returns (failed {row: reason},
    tokens done, seconds, the signal that stopped it or None). SIGTERM/SIGINT finish the batch in flight and its
    files, then return; a full disk is one line."""
    n_states, hidden = plan.n_states, plan.hidden_size
    # a GPU needs several writer threads to keep up (CRC and page-cache copy run at 1-2 GB/s per thread on the lent
    # H200's host; at Kimi's width the forward makes 5 GB/s of states); on CPU one, at low priority, next to the
    # vLLM engine's threads
    writer_threads = args.writer_threads or (min(8, os.cpu_count() or 1) if plan.on_gpu else 1)
    background_writer = engines.kind(args.backend).background_writer_on_cpu and not plan.on_gpu
    failed, done_tokens, written, broken = {}, [0], set(), []
    oom_above, nan_rows = faults.oom_above(), faults.nan_rows()
    lock = threading.Lock()

    def on_done(i, reason):
        with lock:
            if reason:
                failed[i] = reason
                if not written and sum(r == NON_FINITE for r in failed.values()) == min(FIRST_ROWS, len(todo)):
                    broken.append(i)  # the verifier's, not the rows': stopped after the batch in flight
                    return
                log.error(f"row {i}: {reason}; not written")
            else:
                done_tokens[0] += len(rows[i])
                written.add(i)
            progress.update(1, tokens=len(rows[i]))

    writer = Writer(out_dir, rows, n_states, hidden, on_done, storage=args.storage_dtype,
                    threads=writer_threads, depth=max(8, 2 * args.batch_size), nan_rows=nan_rows,
                    background=background_writer, spool=getattr(backend, "staging", None))

    def process(batch):
        try:
            if oom_above and sum(len(rows[i]) for i in batch) > oom_above:
                import torch
                raise torch.OutOfMemoryError(f"injected: {sum(len(rows[i]) for i in batch)} tokens > {oom_above}")
            results = backend.forward([(i, rows[i]) for i in batch])
        except Exception as e:
            if not _is_oom(e):
                raise
            backend.recover()
            if len(batch) == 1:
                with lock:
                    failed[batch[0]] = f"out of memory alone ({len(rows[batch[0]])} tokens)"
                    progress.update(1)
                log.error(f"row {batch[0]}: out of memory even alone ({len(rows[batch[0]])} tokens); skipped")
                return
            half = len(batch) // 2
            log.warning(f"out of memory on a batch of {len(batch)} rows "
                        f"({sum(len(rows[i]) for i in batch):,} tokens); retrying as {half} + {len(batch) - half}")
            process(batch[:half])
            process(batch[half:])
            return
        faults.kill_point("batch")
        for i in batch:
            writer.put(i, results[i])

    stop = {}

    def on_signal(signum, frame):
        if stop:  # the second one: stop now (the rows of unfinished batches are redone by the next run)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        stop["signal"] = signum
        log.warning(f"{signal.Signals(signum).name}: finishing the batch in flight and its files, then stopping "
                    f"(send it again to stop at once)")
    main_thread = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    # stage 01's folder rewritten under this run: one line, before files of two inputs mix (and again in finish)
    watch = stage01("--prepared-data", plan.jsonl, plan.prepared_manifest)
    t0 = time.time()
    batches = make_batches(todo, [len(r) for r in rows], args.batch_size, args.max_tokens_per_batch)
    try:
        for batch in batches:
            if stop:
                break
            if broken:
                break
            watch.maybe_check()
            if faults.armed("between"):
                backend.flush()
                writer.q.join()  # a kill "between batches": after the previous batch's files are all written
                faults.kill_point("between")
            try:
                process(batch)
            except Exception:
                if not stop:
                    raise
                log.warning("the batch in flight was dropped (the engine stopped too); its rows will be redone")
                break
        backend.flush()  # the last batch's host copy
        writer.close()
        if broken:
            raise UsageError(f"--model-path {args.model_path}: its hidden states are not finite on any of the first "
                             f"{min(FIRST_ROWS, len(todo))} rows it ran (weights holding inf or NaN, or a --dtype its "
                             f"values overflow); no hidden-state file was written: check the verifier, then rerun")
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        left = [i for i in todo if i not in written and i not in failed]
        need = sum(len(rows[i]) for i in left) * bytes_per_token(n_states, hidden, writer.storage)
        raise UsageError(f"--output-dir {out_dir}: disk full ({e.strerror}) with {len(left):,} of {len(todo):,} "
                         f"samples left, about {need / 1e9:.2f} GB more needed; free space and rerun the same "
                         f"command (the {len(written):,} files written are kept)")
    finally:
        try:
            backend.flush()  # after an error: writers waiting on a held copy must not wait forever
        except Exception:
            pass  # the writers get "never queued"; the first exception is the one raised
        writer.close(raise_error=False)  # after an error: stop the threads, keep the first exception
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if stop:
        log.warning(f"stopped by {signal.Signals(stop['signal']).name}: {len(written):,} of {len(todo):,} samples "
                    f"written this run; {resume_hint()}")
    return failed, done_tokens[0], time.time() - t0, stop.get("signal")
