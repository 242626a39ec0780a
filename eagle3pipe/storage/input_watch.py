"""Inputs that change or vanish under a running stage end it with one line (RunError, exit 1) instead of mixing two
inputs into one output: each input folder's manifest (its content id) is re-read now and then and before the stage
writes its own manifest, and a file read once at the start is re-hashed if its size, time or inode moved. Stage 04's
batches too: one that came out empty (every sample in it unavailable) is named, and more of them than a stated share
stop the run."""
import hashlib
import logging
import os
import time

from . import files
from ..base import faults
from ..base.errors import RunError, UsageError

log = logging.getLogger("eagle3")
MAX_EMPTY_SHARE = 0.01  # of an epoch's batches, as train_data.MAX_BAD_SHARE is of the rows


def _signature(path):
    try:
        st = os.stat(path)
    except OSError as e:
        return ("gone", e.strerror)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def file_digest(path):
    """The content id stage 01 gives its tokenized_data.jsonl: the SHA-256 of its bytes, 16 hex digits."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()[:16]


class Watch:
    """[(flag, folder, stage, content id at the start, {path: content id of that file or None})]: `check()` raises one
    line when a folder's manifest is gone or names another content id, or a watched file's content changed;
    `maybe_check()` does it at most every `every` seconds."""

    def __init__(self, entries, every=5.0):
        self.entries, self.every, self.last = entries, every, time.monotonic()
        self.signatures = {p: _signature(p) for e in entries for p in e[4]}

    def check(self, full=False):
        """`full`: hash every watched file, moved or not (a stage's last check before its manifest)."""
        for flag, folder, stage, content_id, watched in self.entries:
            why = None
            try:
                m = files.read_manifest(folder)
            except UsageError as e:
                m, why = None, f"its manifest.json is unreadable: {e}"
            if why is None and m is None:
                why = "its manifest.json is gone: is that stage running again?"
            elif why is None and m.get("content_id") != content_id:
                why = f"its manifest's content id is {m.get('content_id')}, it was {content_id} when this run started"
            for path, want in watched.items():
                if why is None and (full or _signature(path) != self.signatures[path]):
                    try:
                        now = file_digest(path)
                    except OSError as e:
                        now = f"unreadable ({e.strerror})"
                    if now != want:
                        why = f"{os.path.basename(path)} was rewritten (content id {now}, it was {want})"
                    self.signatures[path] = _signature(path)
            if why:
                raise RunError(f"{flag} {folder}: changed while this stage ran ({why}); its output would mix two "
                               f"inputs, so it stops here without a manifest: rerun once {files.STAGE_SCRIPTS[stage]} "
                               f"has finished (with --overwrite if the input's content changed)")
        self.last = time.monotonic()

    def maybe_check(self):
        if time.monotonic() - self.last >= self.every:
            self.check()


def stage01(flag, jsonl, manifest):
    """Stage 01's folder as stage 02 reads it: its manifest and tokenized_data.jsonl, whose hash is the content id."""
    cid = manifest["content_id"]
    return Watch([(flag, os.path.dirname(os.path.abspath(jsonl)), "prepare", cid, {jsonl: cid})])


def stage04_inputs(s, prep, ext, voc):
    """Stage 04's input folders (`s`: settings.Train): stage 01's, 02's (offline) and 03's manifests."""
    entries = [("--prepared-data", s.prepared_data, "prepare", prep["content_id"], {}),
               ("--vocab-mapping", s.vocab_mapping, "vocab", voc["content_id"], {})]
    if not s.online:
        entries.append(("--hidden-states", s.hidden_states, "extract", ext.content_id, {}))
    return Watch(entries)


_current = [None]


def watch_training(watch):
    """The Watch stage 04's trainer re-checks at each checkpoint and epoch (training.PipelineTrainer)."""
    _current[0] = watch


def check_training():
    if _current[0] is not None:
        _current[0].check()


class BatchGuard:
    """A data loader of speculators', passed through, but a batch that holds no token (every sample in it was
    unavailable: speculators then trains on a padded, empty one) is named on a warning line, counted, and more than
    MAX_EMPTY_SHARE of an epoch's batches (and more than one) stop the run with one line. It also keeps the clock
    the dense log reads (`clock()`): the seconds spent waiting on the loader and the tokens it handed out, since the
    epoch's first batch was asked for. `steps`: what each batch goes through on its way to the trainer, in order
    (a profile's step boundary, step_profile.StepProfile; fp8's dequantization on the GPU, fp8_transport.Unpack),
    outside the time counted as waiting."""

    def __init__(self, loader, what="training", steps=()):
        self.loader, self.what, self.empty, self.steps = loader, what, 0, [s for s in steps if s is not None]
        self.waited, self.tokens, self.started = 0.0, 0, None

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def clock(self):
        """(when this epoch's iteration began, seconds waited on the loader and tokens handed out since then), or None
        before the first epoch. Waiting is timed on this process's clock, around the loader alone: speculators'
        own step timer synchronizes the GPU at its marks, so with --log-every above 1 its "fetch" time also holds the
        previous step's GPU work still queued (on one H200 at Kimi's width: 31-33 % read as data wait)."""
        return None if self.started is None else (self.started, self.waited, self.tokens)

    def __iter__(self):
        it, k = iter(self.loader), 0
        self.waited, self.tokens, self.started = 0.0, 0, time.perf_counter()
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.waited += time.perf_counter() - t0
            k += 1
            if self.what == "training":
                faults.oom_point(k)  # a reliability test: out of memory at this step
            ids = batch.get("document_ids") if isinstance(batch, dict) else None
            n = None if ids is None else int((ids != -1).sum())
            self.tokens += n or 0
            if n == 0:
                self.empty += 1
                log.warning(f"{self.what} batch {k}: came out empty (every sample in it was unavailable; "
                            f"logs/skipped.jsonl names them): it adds nothing")
                if self.empty > max(1, MAX_EMPTY_SHARE * len(self.loader)):
                    raise RunError(f"{self.empty} {self.what} batches came out empty (every sample in them unavailable: "
                                   f"hidden-state files deleted or replaced under the run?), more than "
                                   f"{MAX_EMPTY_SHARE:.0%} of {len(self.loader)}; check --hidden-states, then rerun")
            for step in self.steps:
                batch = step(batch)
            yield batch
