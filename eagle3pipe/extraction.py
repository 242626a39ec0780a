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

from .hidden_states import check_file, hs_path, save

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


def scan_existing(out_dir, rows, n_states, hidden, workers=4):
    """Indices of rows whose file is valid; invalid files are removed (they will be redone)."""
    from concurrent.futures import ThreadPoolExecutor
    names = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    cand = [i for i in range(len(rows)) if os.path.basename(hs_path(out_dir, i)) in names]

    def one(i):
        reason = check_file(hs_path(out_dir, i), rows[i], n_states, hidden)
        if reason:
            log.warning(f"hs_{i}.safetensors: {reason}; it will be extracted again")
            os.remove(hs_path(out_dir, i))
        return i, reason is None
    with ThreadPoolExecutor(workers) as ex:
        return {i for i, ok in ex.map(one, cand) if ok}


def _is_oom(e):
    import torch
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


class Writer(threading.Thread):
    """Validates and writes results in the background; a bounded queue applies back-pressure."""

    def __init__(self, out_dir, rows, n_states, hidden, on_done, depth=8):
        super().__init__(daemon=True, name="hs-writer")
        self.q = queue.Queue(maxsize=depth)
        self.out_dir, self.rows, self.n_states, self.hidden, self.on_done = out_dir, rows, n_states, hidden, on_done
        self.error = None

    def run(self):
        import torch
        while True:
            item = self.q.get()
            if item is None:
                return
            i, result = item
            try:
                final = hs_path(self.out_dir, i)
                if isinstance(result, str):  # a file the engine wrote (vLLM): validate, then move into place
                    reason = check_file(result, self.rows[i], self.n_states, self.hidden)
                    if reason is None:
                        os.replace(result, final)
                    else:
                        os.remove(result)
                else:
                    reason = None if torch.isfinite(result).all() else "non-finite values"
                    if reason is None:
                        save(final, result, torch.as_tensor(self.rows[i], dtype=torch.int64))
                self.on_done(i, reason)
            except Exception as e:  # a full disk, a dead filesystem: stop the run, do not skip samples
                self.error = e
                return

    def put(self, i, result):
        if self.error:
            raise self.error
        self.q.put((i, result))

    def close(self):
        self.q.put(None)
        self.join()
        if self.error:
            raise self.error


def run(backend, rows, todo, out_dir, args, n_states, hidden, progress):
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

    writer = Writer(out_dir, rows, n_states, hidden, on_done)
    writer.start()

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
            r = results[i]
            if i in nan_rows and not isinstance(r, str):
                r = r.clone()
                r.view(-1)[0] = float("nan")
            writer.put(i, r)

    t0 = time.time()
    try:
        for batch in make_batches(todo, [len(r) for r in rows], args.batch_size, args.max_tokens_per_batch):
            process(batch)
    finally:
        writer.close()
    return failed, done_tokens[0], time.time() - t0
