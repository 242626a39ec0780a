"""Stage 02's run loop, shared by the vLLM and HF backends.

- Resume: a row whose file exists and validates is skipped; the rest are batched, longest first, so the
  worst-case batch runs in the first minute rather than after hours.
- OOM never kills the run: a batch that raises the framework's out-of-memory error is split in half and
  retried, down to one sample; a sample that cannot fit alone is recorded as failed. The model stays loaded.
- A background writer validates (finite values, token ids) and writes each file atomically, overlapping the
  writes with the next batch's compute. A non-finite sample is recorded as failed, never written.
- Fault injection, for tests of the real loop: EAGLE3_INJECT_OOM_ABOVE_TOKENS=N raises torch's own
  OutOfMemoryError for any forward over N tokens; EAGLE3_INJECT_NAN_ROWS=3,7 poisons those rows' states.
"""
import logging
import os
import queue
import threading
import time

from .hidden_states import SCALES, check_file, hs_path, load_checked, quantize_fp8, save

log = logging.getLogger("eagle3")


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
    from concurrent.futures import ThreadPoolExecutor
    workers = workers or min(16, (os.cpu_count() or 1) * 2)  # reads and CRCs release the GIL
    with ThreadPoolExecutor(workers) as ex:
        return dict(zip(indices, ex.map(lambda i: check_file(hs_path(out_dir, i), rows[i], n_states, hidden), indices)))


def scan_existing(out_dir, rows, n_states, hidden, indices=None):
    """Rows (of `indices`, default all) whose file is valid; invalid files are removed (they will be redone)."""
    names = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    indices = range(len(rows)) if indices is None else indices
    cand = [i for i in indices if os.path.basename(hs_path(out_dir, i)) in names]
    ok = set()
    for i, reason in check_all(out_dir, rows, cand, n_states, hidden).items():
        if reason:
            log.warning(f"hs_{i}.safetensors: {reason}; it will be extracted again")
            os.remove(hs_path(out_dir, i))
        else:
            ok.add(i)
    return ok


def _is_oom(e):
    import torch
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


class Writer:
    """Validates and writes results on background threads; a bounded queue applies back-pressure.

    A result is either a path the engine wrote (vLLM: wait for its lock, validate, rewrite with a checksum, and in
    fp8 if asked) or a Pending (HF: host tensors whose device-to-host copy completes at `event`)."""

    def __init__(self, out_dir, rows, n_states, hidden, on_done, storage="bf16", threads=1, depth=8, nan_rows=()):
        self.q = queue.Queue(maxsize=depth)
        self.out_dir, self.rows, self.n_states, self.hidden, self.on_done = out_dir, rows, n_states, hidden, on_done
        self.storage, self.nan_rows, self.error = storage, set(nan_rows), None
        self.threads = [threading.Thread(target=self._loop, daemon=True, name=f"hs-writer-{k}") for k in range(threads)]
        for t in self.threads:
            t.start()

    def _tensors(self, i, result):
        """-> ({name: CPU tensor} to save, None) or (None, the reason the sample is bad)."""
        import torch
        if isinstance(result, str):
            reason, tensors = load_engine_file(result, self.rows[i], self.n_states, self.hidden)
            os.remove(result)
            if reason:
                return None, reason
            if i in self.nan_rows:  # fault injection: poison the states the real check below sees
                tensors["hidden_states"] = tensors["hidden_states"].clone()
                tensors["hidden_states"].view(-1)[0] = float("nan")
            bad = not torch.isfinite(tensors["hidden_states"]).all()
        else:
            if result.event is not None:
                result.event.synchronize()  # this sample's device-to-host copy is complete
            tensors, bad = dict(result.tensors), bool(result.bad)  # checked on the device
        if bad:
            return None, "non-finite values"
        if self.storage == "fp8" and SCALES not in tensors:
            tensors["hidden_states"], tensors[SCALES] = quantize_fp8(tensors["hidden_states"])
        tensors["token_ids"] = torch.as_tensor(self.rows[i], dtype=torch.int64)
        return tensors, None

    def _loop(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            i, result = item
            try:
                tensors, reason = self._tensors(i, result)
                if tensors is not None:
                    save(hs_path(self.out_dir, i), tensors)
                self.on_done(i, reason)
            except Exception as e:  # a full disk, a dead filesystem: stop the run, do not skip samples
                self.error = self.error or e
                while True:  # keep draining so the producer never blocks on a dead writer
                    if self.q.get() is None:
                        return

    def put(self, i, result):
        if self.error:
            raise self.error
        self.q.put((i, result))

    def close(self):
        for _ in self.threads:
            self.q.put(None)
        for t in self.threads:
            t.join()
        if self.error:
            raise self.error


def load_engine_file(path, token_ids, n_states, hidden):
    """A file vLLM's connector wrote: wait until it is complete (its .lock), then -> (reason or None, tensors)."""
    import fcntl
    lock = path + ".lock"
    if os.path.exists(lock):  # held by the engine's writer thread until the file is complete
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)
        os.remove(lock)
    reason, tensors = load_checked(path, token_ids, n_states, hidden)
    return reason, tensors and {"hidden_states": tensors["hidden_states"]}


class Pending:
    """One sample's host tensors ({"hidden_states": [T, L+1, H], maybe "hidden_states_scales": [T, 1, 1]}) and
    `bad` (a 0-d bool tensor: non-finite values), valid once `event` (a CUDA event; None on CPU) has completed:
    the device-to-host copy runs behind the next batch's compute."""
    __slots__ = ("tensors", "event", "bad")

    def __init__(self, tensors, event=None, bad=False):
        self.tensors, self.event, self.bad = tensors, event, bad


def run(backend, rows, todo, out_dir, args, n_states, hidden, progress, writer_threads=1):
    """Extract every row in `todo`. Returns (failed {row: reason}, tokens done, seconds)."""
    failed, done_tokens = {}, [0]
    oom_above = int(os.environ.get("EAGLE3_INJECT_OOM_ABOVE_TOKENS", "0") or 0)
    nan_rows = {int(x) for x in os.environ.get("EAGLE3_INJECT_NAN_ROWS", "").split(",") if x.strip()}
    lock = threading.Lock()

    def on_done(i, reason):
        with lock:
            if reason:
                failed[i] = reason
                log.error(f"row {i}: {reason}; not written")
            else:
                done_tokens[0] += len(rows[i])
            progress.update(1, tokens=len(rows[i]))

    writer = Writer(out_dir, rows, n_states, hidden, on_done, storage=getattr(args, "storage_dtype", "bf16"),
                    threads=writer_threads, depth=max(8, 2 * args.batch_size), nan_rows=nan_rows)

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
        for i in batch:
            writer.put(i, results[i])

    t0 = time.time()
    batches = make_batches(todo, [len(r) for r in rows], args.batch_size, args.max_tokens_per_batch)
    try:
        for batch in batches:
            process(batch)
    finally:
        writer.close()
    return failed, done_tokens[0], time.time() - t0
