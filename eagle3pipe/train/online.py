"""Stage 04 --online: train on hidden states generated on demand, ahead of the trainer, then discarded (or kept in a
bounded cache). No stage 02 folder is needed.

How (built on speculators' own on-demand generation, `on_missing="generate"`):
- an extraction engine, configured as stage 02 configures its backends (same layer ids and convention, the
  hidden-states connector, the CPU settings, tensor parallel over `--engine-gpus`), runs as a child process with an
  OpenAI-compatible endpoint: vLLM's server (`--backend vllm`) or ours around transformers (`--backend hf`,
  hf_server.py). Or one already running (`--engine-address`).
- speculators' ArrowDataset asks it for a sample's states with its own client (`generate_hidden_states`), checks
  them (token ids, finite values; retries, a circuit breaker) and reads them through a transfer. We add two things:
  `OnlineArrowDataset.__getitems__` asks for all of a packed batch's samples at once (speculators asks one at a
  time, which leaves the engine batching nothing), and `CacheTransfer`, which moves each generated file into a cache
  folder of stage 02's format while `--cache-gb` allows, else deletes it. Later epochs read cached samples instead
  of generating them.
- the data-loader workers prefetch batches (`prefetch_factor`): generation runs ahead of the training step.

Disk: at most the cache budget, plus the files in flight (workers x prefetch x one batch).
Faults: a sample whose states come back non-finite (or fail twice) is skipped and listed in logs/skipped.jsonl; an
engine that dies stops the run with one line (the checkpoints are kept, the same command resumes).

Rooms: online_plan.py (the preflight), online_engine.py (the engine process), sample_cache.py (what the loaders read);
here, `Session`, the one owner of an online run's lifecycle.
"""
import logging
import os
import sys

from . import online_plan, sample_cache, train_data
from ..base.errors import resume_hint
from ..engines import online_engine
from ..formats.spool import clear_spool
from ..storage import outdir

log = logging.getLogger("eagle3")


class Session:
    """An online run's engine and data, entered around training. On entry, rank 0 prepares the spool and the
    cache, starts the engine (or checks the one at --engine-address), watches it and writes the training table with
    its URL; every rank waits for that table and registers the transfer. On exit the engine stops.
    `loaders()` adapts speculators' loaders for training.run; `summary()` goes into the manifest."""

    def __init__(self, args, plan, out, rank, rows, bridge):
        self.args, self.plan, self.out, self.rank, self.rows, self.bridge = args, plan, out, rank, rows, bridge
        self.server, self.url, self.spool = None, None, None

    def __enter__(self):
        args, p, out = self.args, self.plan, self.out
        try:
            if self.rank == 0:
                log.info(online_plan.describe(p, args.backend))
                self.spool = sample_cache.prepare(out, p)
                self.server = online_engine.launch(args, p, out, self.rows[0][0][:16].tolist(), self.spool)
                self.server.watch(lambda why: stop_run(f"the extraction engine {why}", out))
                train_data.build_bridge(self.rows, self.bridge, self.server.url)
            self.url = train_data.wait_for_bridge(self.bridge, timeout=args.engine_timeout + 600)
            sample_cache.install(out, p, self.url)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        if self.server:
            self.server.stop()
        if self.spool and not self.plan.spool:  # ours: what the stopped engine left in flight goes, then the folder
            clear_spool(self.spool)
            outdir.remove(self.spool)

    def loaders(self):
        return sample_cache.loaders()

    def batch_step(self, device):
        return None  # the engine's states reach the trainer in the compute dtype

    def summary(self):
        return {"online": sample_cache.summary(self.out, self.plan)}


def stop_run(reason, out):
    """The engine died mid-run: one line, and out at once (the data-loader workers notice and exit too)."""
    print(f"error: {reason}; the checkpoints so far are kept in {out}: {resume_hint()}",
          file=sys.stderr, flush=True)
    os._exit(1)
