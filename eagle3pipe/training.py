"""Stage 04's glue around speculators' trainer: cross-stage checks, the data bridge, the TrainConfig, a CPU
compatibility layer, the dense log line and the `last` / `best` checkpoint pointers.

The training itself is speculators' (`speculators.train.cli.main`: Eagle3 draft built from the verifier's
config, packed batches, TTT steps, checkpoints with mid-epoch resume, DDP/FSDP under torchrun). We bridge our
stages into it without copying hidden states: stage 01's JSONL becomes the small Arrow table speculators reads
(input_ids, loss_mask, seq_len), and its `hidden_states_path` points at stage 02's folder.
"""
import json
import logging
import os
import time

from .cli import UsageError
from .files import STAGE_SCRIPTS, load_stage
from .hidden_states import check_header, hs_path, verify_crc
from .verifier import same_verifier

log = logging.getLogger("eagle3")


def _mismatch(what, a_name, a, b_name, b, rerun):
    diff = same_verifier(a, b)
    if diff:
        raise UsageError(f"{what}: {a_name} and {b_name} come from different verifiers ({diff}: {a.get(diff)} vs "
                         f"{b.get(diff)}); rerun {STAGE_SCRIPTS[rerun]}")


def check_inputs(args, fp, verify_data=True):
    """All cross-stage checks, before torch: -> (prep, extract, vocab manifests, rows [(ids, mask)], failed rows)."""
    prep = load_stage("--prepared-data", args.prepared_data, "prepare")
    ext = load_stage("--hidden-states", args.hidden_states, "extract")
    voc = load_stage("--vocab-mapping", args.vocab_mapping, "vocab")
    _mismatch("--prepared-data", "--model-path", fp, "stage 01", prep["verifier"], "prepare")
    _mismatch("--hidden-states", "stage 01", prep["verifier"], "stage 02", ext["verifier"], "extract")
    _mismatch("--vocab-mapping", "stage 01", prep["verifier"], "stage 03", voc["verifier"], "vocab")
    if ext["identity"]["prepared"] != prep["content_id"] or ext["counts"]["rows"] != prep["counts"]["rows"]:
        raise UsageError(f"--hidden-states {args.hidden_states}: extracted from another stage 01 run than "
                         f"--prepared-data {args.prepared_data}; rerun {STAGE_SCRIPTS['extract']}")
    import numpy as np
    d2t_path, t2d_path = (os.path.join(args.vocab_mapping, n) for n in ("d2t.npy", "t2d.npy"))
    try:
        d2t, t2d = np.load(d2t_path), np.load(t2d_path)
    except (OSError, ValueError) as e:
        raise UsageError(f"--vocab-mapping {args.vocab_mapping}: unreadable d2t/t2d ({e}); rerun 03_build_vocab_mapping.py")
    k, v = voc["counts"]["draft_vocab_size"], fp["vocab_size"]
    if d2t.shape != (k,) or t2d.shape != (v,) or int(t2d.sum()) != k or \
            not np.array_equal(np.arange(k) + d2t, np.flatnonzero(t2d)):
        raise UsageError(f"--vocab-mapping {args.vocab_mapping}: d2t {list(d2t.shape)} / t2d {list(t2d.shape)} do not "
                         f"form a {k}-of-{v} mapping; rerun 03_build_vocab_mapping.py")
    rows = []
    with open(os.path.join(args.prepared_data, "tokenized_data.jsonl"), encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            rows.append((r["input_ids"], r["loss_mask"]))
    n_states, hidden = len(ext["layer_ids"]), ext["verifier"]["hidden_size"]
    failed = {int(i) for i in ext.get("failures", {})}
    bad = []
    for i, (ids, _) in enumerate(rows):
        if i in failed:
            continue
        reason = check_header(hs_path(args.hidden_states, i), len(ids), n_states, hidden)
        if reason:
            bad.append((i, reason))
    if not bad and verify_data:  # every byte against its CRC: a flipped bit must not reach the trainer
        from concurrent.futures import ThreadPoolExecutor
        todo = [i for i in range(len(rows)) if i not in failed]
        with ThreadPoolExecutor(min(16, 2 * (os.cpu_count() or 1))) as ex:
            crcs = ex.map(lambda i: verify_crc(hs_path(args.hidden_states, i)), todo)
            bad = [(i, r) for i, r in zip(todo, crcs) if r]
    if bad:
        i, reason = bad[0]
        raise UsageError(f"--hidden-states {args.hidden_states}: {len(bad)} bad file(s), e.g. hs_{i}.safetensors: "
                         f"{reason}; rerun {STAGE_SCRIPTS['extract']} (it redoes only those)")
    return prep, ext, voc, rows, failed


def build_bridge(rows, folder):
    """Stage 01's rows as the Arrow table speculators' ArrowDataset reads. Row order is kept: row i <-> hs_i.
    Rows whose extraction failed stay in the table (their file is absent: speculators skips them)."""
    import datasets
    ds = datasets.Dataset.from_dict({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows],
                                     "seq_len": [len(r[0]) for r in rows]})
    ds.set_format(type="torch")
    tmp = folder + f".tmp-{os.getpid()}"
    ds.save_to_disk(tmp)
    if os.path.isdir(folder):
        import shutil
        shutil.rmtree(folder)
    os.rename(tmp, folder)
    open(os.path.join(folder, ".done"), "w").close()


def wait_for_bridge(folder, timeout=600):
    deadline = time.time() + timeout
    while not os.path.exists(os.path.join(folder, ".done")):
        if time.time() > deadline:
            raise RuntimeError(f"rank 0 did not build {folder} in {timeout} s")
        time.sleep(0.5)


class DenseLog(logging.Handler):
    """One line every N steps from speculators' metric records: step/total, loss, per-position accuracy, lr,
    tok/s, ETA. Plain text, so it reads the same in a terminal and in a nohup log."""

    def __init__(self, every, total_steps=None, jsonl=None):
        super().__init__()
        self.every, self.total, self.t0, self.step0, self.tokens = every, total_steps, None, None, 0
        self.jsonl = jsonl  # every metric record, one JSON line each: stage 05 plots the training curves

    def emit(self, record):
        msg = record.msg
        if not isinstance(msg, dict) or not ("train" in msg or "val" in msg):
            return
        if self.jsonl:
            with open(self.jsonl, "a", encoding="utf-8") as f:
                f.write(json.dumps(msg, default=float) + "\n")
        if "train" not in msg:
            return
        step = msg.get("global_step", 0) + 1
        if self.t0 is None:
            self.t0, self.step0 = time.time(), step - 1
        m, prof = msg["train"], msg.get("profile") or {}
        if step % self.every and step != self.total:
            return
        acc = " ".join(f"{m[k]:.2f}" for k in sorted(k for k in m if "acc" in k and "full" in k)) or \
            " ".join(f"{m[k]:.2f}" for k in sorted(k for k in m if "acc" in k))
        done = step - self.step0
        rate = (time.time() - self.t0) / max(done, 1)
        eta = f" ETA {int(rate * (self.total - step)) // 60}m{int(rate * (self.total - step)) % 60:02d}s" \
            if self.total else ""
        lr = msg.get("lr")
        lr = lr if isinstance(lr, (int, float)) else next(iter(lr.values()), 0) if isinstance(lr, dict) else 0
        total = f"/{self.total}" if self.total else ""
        log.info(f"step {step}{total} epoch {msg.get('epoch', 0)} loss {m.get('loss', float('nan')):.4f} "
                 f"acc[{acc}] lr {lr:.2e} {prof.get('tokens_per_s', 0):,.0f} tok/s{eta}")


def apply_cpu_compat():
    """speculators 0.9.0's Trainer assumes an accelerator. Four points, handled only when none is present:
    1. `model.to(local_rank)` with the integer 0 means cuda:0 -> move to "cpu" instead (PipelineTrainer);
    2. its step timer calls `torch.accelerator.synchronize()`, which raises with no accelerator -> a no-op;
    3. autocast's device_type falls back to "cuda" -> "cpu" (bf16 autocast works on CPU) (PipelineTrainer);
    4. the fused loss needs a Triton GPU driver and flex attention is GPU-only -> the eager loss and sdpa
       attention, chosen in train_config().
    And one more, found on resume: its checkpointer loads onto `get_current_device()`, which says "cuda:0"
    with no accelerator -> "cpu". Nothing of speculators is forked or copied."""
    import torch
    import speculators.train.checkpointer as ckpt
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.synchronize = lambda *a, **k: None
        ckpt.get_current_device = lambda: "cpu"


def make_trainer_class(dense_log, on_cpu, max_steps):
    from speculators.train.trainer import Trainer

    class PipelineTrainer(Trainer):
        def setup_model(self):
            if on_cpu:
                self.local_rank, self.device_type = "cpu", "cpu"
            super().setup_model()
            steps = len(self.train_loader) * self.config.num_epochs
            dense_log.total = min(steps, max_steps) if max_steps else steps

        def train_epoch(self, epoch, **kw):
            if max_steps and self.global_step >= max_steps:
                return  # speculators would run one more step per remaining epoch
            return super().train_epoch(epoch, **kw)

        def run_training(self):
            # speculators 0.9 keeps looping over the remaining epochs after --max-steps, each one saving a
            # checkpoint and validating; stop at the epoch in which the last step falls
            if max_steps:
                need = -(-max_steps // max(1, len(self.train_loader)))
                self.config = self.config._replace(num_epochs=min(self.config.num_epochs, need))
            return super().run_training()

        def maybe_save_checkpoint(self, epoch, local_step=0):
            super().maybe_save_checkpoint(epoch, local_step)
            path = self.checkpointer.path / str(epoch)
            if (self.rank == 0) and (path / "config.json").exists():
                link = self.checkpointer.path / "last"
                tmp = self.checkpointer.path / ".last.tmp"
                if tmp.is_symlink():
                    tmp.unlink()
                tmp.symlink_to(str(epoch), target_is_directory=True)
                os.replace(tmp, link)  # a stable pointer that is never missing
    return PipelineTrainer


def prepare_output(out, identity, overwrite, rank):
    """Resume only with the same inputs; --overwrite clears our checkpoints (never anything else)."""
    import shutil
    from .files import RUN_FILE, read_json, write_json
    run_file = os.path.join(out, RUN_FILE)
    if rank != 0:
        return
    if overwrite and os.path.isdir(out):
        for name in os.listdir(out):
            p = os.path.join(out, name)
            if name.isdigit() or name in ("last", "checkpoint_best", "interrupted", "logs", ".bridge", RUN_FILE,
                                          "manifest.json", "run.yaml", "train_command.txt") or name.startswith("epoch"):
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    os.makedirs(out, exist_ok=True)
    if os.path.exists(run_file):
        old = read_json(run_file).get("identity")
        if old != identity:
            what = next((k for k in identity if (old or {}).get(k) != identity[k]), "inputs")
            raise UsageError(f"--output-dir {out}: holds checkpoints trained on other inputs ({what} differs); "
                             f"use --overwrite or another folder")
    write_json(run_file, {"stage": "train", "identity": identity})


def train_config(args, bridge, aux_layer_ids, on_cpu, storage="bf16"):
    from speculators.train.config import TrainConfig
    # GPU: up to 12 workers per rank (speculators' default) but no more than the cores each rank has: reading
    # per-sample files is most of a step's input cost. CPU: none, the training step already uses every core.
    per_rank = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    workers = args.num_workers if args.num_workers is not None else (0 if on_cpu else max(1, min(12, per_rank - 1)))
    flat = {
        "speculator_type": "eagle3", "verifier_name_or_path": args.model_path,
        "trust_remote_code": args.trust_remote_code, "num_layers": args.num_layers, "ttt_steps": args.ttt_steps,
        "target_layer_ids": aux_layer_ids,
        "d2t_path": os.path.join(args.vocab_mapping, "d2t.npy"), "t2d_path": os.path.join(args.vocab_mapping, "t2d.npy"),
        "draft_vocab_size": None, "data_path": bridge, "hidden_states_path": os.path.abspath(args.hidden_states),
        "hidden_states_backend": "fp8" if storage == "fp8" else "file",  # FP8Transfer dequantizes on load
        "on_missing": "skip", "total_seq_len": args.total_seq_len, "train_data_ratio": 1 - args.val_ratio,
        "num_workers": workers, "prefetch_factor": 4, "epochs": args.epochs, "lr": args.lr,
        "max_steps": args.max_steps, "scheduler_warmup_steps": args.warmup_steps,
        "checkpoint_freq": args.checkpoint_freq, "log_freq": args.log_every, "save_path": os.path.abspath(args.output_dir),
        "log_dir": os.path.join(os.path.abspath(args.output_dir), "logs"), "seed": args.seed, "fsdp_shard": args.fsdp,
        "logger": "",
    }
    if on_cpu:  # no Triton driver, no flex attention: speculators' eager loss and torch's sdpa
        flat.update(draft_attn_impl="sdpa", loss_implementation="eager")
    if args.loss_implementation != "auto":
        flat["loss_implementation"] = args.loss_implementation
    return TrainConfig.from_flat(flat)


def run(cfg, args, on_cpu):
    """speculators' own training entry point, with our Trainer subclass and dense log attached."""
    import speculators.train.cli as scli
    if on_cpu:
        apply_cpu_compat()
    import warnings
    warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator.*")
    logs = os.path.join(os.path.abspath(args.output_dir), "logs")
    os.makedirs(logs, exist_ok=True)
    dense = DenseLog(every=1, total_steps=args.max_steps, jsonl=os.path.join(logs, "metrics.jsonl"))
    setup = scli.setup_metric_logger

    def setup_metric_logger(*a, **k):
        """speculators' metric records are raw dicts printed through the root logger; keep its metric
        backends (tensorboard, wandb, ...) and print our dense line instead of the dicts."""
        setup(*a, **k)
        metrics = logging.getLogger("speculators.metrics")
        metrics.propagate = False
        if int(os.environ.get("RANK", "0")) == 0:
            metrics.addHandler(dense)
    scli.setup_metric_logger = setup_metric_logger
    trainer_cls = make_trainer_class(dense, on_cpu, args.max_steps)
    holder = {}

    class Recording(trainer_cls):
        def setup_model(self):
            holder["trainer"] = self
            super().setup_model()
    scli.Trainer = Recording
    scli.main(cfg)
    t = holder.get("trainer")
    path = t.checkpointer.path if t else None
    real = lambda name: os.path.realpath(path / name) if path and (path / name).exists() else None  # noqa: E731
    return {"steps": t.global_step if t else 0, "checkpoint_last": real("last"),
            "checkpoint_best": real("checkpoint_best"), "best_val_loss": getattr(t, "best_val_loss", None)}
