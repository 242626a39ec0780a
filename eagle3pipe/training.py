"""Stage 04's glue around speculators' trainer: cross-stage checks, the data bridge, the TrainConfig, a CPU
compatibility layer, the dense log line and the `last` / `best` checkpoint pointers.

The training itself is speculators' (`speculators.train.cli.main`: Eagle3 draft built from the verifier's
config, packed batches, TTT steps, checkpoints with mid-epoch resume, DDP/FSDP under torchrun). We bridge our
stages into it without copying hidden states: stage 01's JSONL becomes the small Arrow table speculators reads
(input_ids, loss_mask, seq_len), and its `hidden_states_path` points at stage 02's folder.
"""
import contextlib
import json
import logging
import os
import threading
import time

from . import files, outdir
from .errors import RunError, UsageError
from .files import STAGE_SCRIPTS, load_stage
from .hidden_states import SCALES, check_header, hs_path, load_sample, read_token_ids, verify_crc
from .verifier import same_verifier

STAGING = ".saving"  # speculators writes each checkpoint here; it is renamed into place once complete
# what speculators' save writes into STAGING/<epoch> (Checkpointer: save_pretrained, the optimizer and scheduler
# states, training_state.json, the command, validation metrics; config.py: the draft's code beside its config)
SAVE_FILES = (r"config\.json|config\.py|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|"
              r"model\.safetensors\.index\.json|optimizer_state_dict\.pt|scheduler_state_dict\.pt|"
              r"training_state\.json|train_command\.txt|val_metrics\.json")
DATASET_FILES = r"data-\d+-of-\d+\.arrow|dataset_info\.json|state\.json|\.done"  # datasets' save_to_disk, and ours

log = logging.getLogger("eagle3")


def _mismatch(what, a_name, a, b_name, b, rerun):
    diff = same_verifier(a, b)
    if diff:
        raise UsageError(f"{what}: {a_name} and {b_name} come from different verifiers ({diff}: {a.get(diff)} vs "
                         f"{b.get(diff)}); rerun {STAGE_SCRIPTS[rerun]}")


def check_inputs(args, fp, verify_data=True, online_layer_ids=None):
    """All cross-stage checks, before torch: -> (prep, extract, vocab manifests, rows [(ids, mask)], failed rows).
    With --online (`online_layer_ids`) there is no stage 02 folder: `extract` describes the states the engine makes."""
    from .files import content_id
    prep = load_stage("--prepared-data", args.prepared_data, "prepare")
    voc = load_stage("--vocab-mapping", args.vocab_mapping, "vocab")
    if online_layer_ids:
        ext = {"layer_ids": online_layer_ids, "verifier": fp, "storage_dtype": "bf16",
               "content_id": "online-" + content_id([online_layer_ids, prep["content_id"]])}
    else:
        ext = load_stage("--hidden-states", args.hidden_states, "extract")
        _mismatch("--hidden-states", "stage 01", prep["verifier"], "stage 02", ext["verifier"], "extract")
        if ext["identity"]["prepared"] != prep["content_id"] or ext["counts"]["rows"] != prep["counts"]["rows"]:
            raise UsageError(f"--hidden-states {args.hidden_states}: extracted from another stage 01 run than "
                             f"--prepared-data {args.prepared_data}; rerun {STAGE_SCRIPTS['extract']}")
        if args.layer_ids and list(args.layer_ids) + [fp["num_hidden_layers"]] != ext["layer_ids"] and \
                list(args.layer_ids) != ext["layer_ids"]:
            raise UsageError(f"--layer-ids {args.layer_ids}: stage 02 extracted {ext['layer_ids'][:-1]} into "
                             f"--hidden-states {args.hidden_states}; give those, or rerun {STAGE_SCRIPTS['extract']}")
    _mismatch("--prepared-data", "--model-path", fp, "stage 01", prep["verifier"], "prepare")
    _mismatch("--vocab-mapping", "stage 01", prep["verifier"], "stage 03", voc["verifier"], "vocab")
    import numpy as np
    d2t_path, t2d_path = (os.path.join(args.vocab_mapping, n) for n in ("d2t.npy", "t2d.npy"))
    try:
        from .files import load_npy
        d2t, t2d = load_npy(d2t_path), load_npy(t2d_path)
    except (OSError, ValueError) as e:
        raise UsageError(f"--vocab-mapping {args.vocab_mapping}: unreadable d2t/t2d ({e}); rerun 03_build_vocab_mapping.py")
    k, v = voc["counts"]["draft_vocab_size"], fp["vocab_size"]
    if d2t.shape != (k,) or t2d.shape != (v,) or int(t2d.sum()) != k or \
            not np.array_equal(np.arange(k) + d2t, np.flatnonzero(t2d)):
        raise UsageError(f"--vocab-mapping {args.vocab_mapping}: d2t {list(d2t.shape)} / t2d {list(t2d.shape)} do not "
                         f"form a {k}-of-{v} mapping; rerun 03_build_vocab_mapping.py")
    rows = files.read_rows(args.prepared_data, prep["counts"]["rows"])
    if online_layer_ids:
        if rows.digest != prep["content_id"]:
            raise UsageError(f"--prepared-data {args.prepared_data}: tokenized_data.jsonl was edited after stage 01 "
                             f"wrote it (its hash is not the manifest's content_id); rerun {STAGE_SCRIPTS['prepare']}")
        return prep, ext, voc, rows, set()
    n_states, hidden = len(ext["layer_ids"]), ext["verifier"]["hidden_size"]
    failed = {int(i) for i in ext.get("failures", {})}
    if rows.digest != prep["content_id"]:
        changed = next((i for i, (ids, _) in enumerate(rows) if i not in failed and _stored_ids(args, i) != ids), None)
        where = (f"row {changed} (line {changed + 1}) differs from the tokens stage 02 extracted into "
                 f"hs_{changed}.safetensors" if changed is not None else "its hash is not the manifest's content_id")
        raise UsageError(f"--prepared-data {args.prepared_data}: tokenized_data.jsonl was edited after stage 01 wrote "
                         f"it ({where}); rerun {STAGE_SCRIPTS['prepare']}, then the later stages")
    bad = []
    for i, (ids, _) in enumerate(rows):
        if i in failed:
            continue
        reason = check_header(hs_path(args.hidden_states, i), len(ids), n_states, hidden)
        if reason:
            bad.append((i, reason))
    if not bad and verify_data:  # --verify-data: every byte against its CRC before step 1 (else as each is read)
        from concurrent.futures import ThreadPoolExecutor

        def verify(i):
            reason = verify_crc(hs_path(args.hidden_states, i))
            return reason or (None if _stored_ids(args, i) == rows[i][0] else "token_ids differ from the prepared row")
        todo = [i for i in range(len(rows)) if i not in failed]
        with ThreadPoolExecutor(min(16, 2 * (os.cpu_count() or 1))) as ex:
            bad = [(i, r) for i, r in zip(todo, ex.map(verify, todo)) if r]
    if bad:
        i, reason = bad[0]
        raise UsageError(f"--hidden-states {args.hidden_states}: {len(bad)} bad file(s), e.g. hs_{i}.safetensors: "
                         f"{reason}; rerun {STAGE_SCRIPTS['extract']} (it redoes only those)")
    return prep, ext, voc, rows, failed


CHECKED = "eagle3pipe-checked"  # our transfer's name in speculators' backend registry
MAX_BAD_SHARE = 0.01  # of the rows: more bad samples than this (and more than one) stop the run


class CheckedFiles:
    """speculators' HiddenStatesTransfer for offline training: stage 02's files, each read once and checked where it
    is read (hidden_states.load_sample: header, dtypes, CRC-32, finite values), not in a pass over every byte before
    step 1. A bad sample is skipped and logged in logs/skipped.jsonl; more than MAX_BAD_SHARE of the rows (and more
    than one) stop the run with one line. Picklable: data-loader workers get a copy."""

    def __init__(self, folder, n_states, hidden, skipped_log, rows, dtype="bfloat16", failed=()):
        self.folder, self.n_states, self.hidden, self.skipped_log = folder, n_states, hidden, skipped_log
        self.rows, self.dtype, self.failed = rows, dtype, frozenset(failed)

    def __setstate__(self, state):
        self.__dict__.update(state)
        outdir.attach(os.path.dirname(os.path.dirname(self.skipped_log)))  # a spawned worker logs into our record

    def setup(self):
        pass

    def get_cached(self, file_idx):
        path = hs_path(self.folder, int(file_idx))
        if not os.path.lexists(path):
            if int(file_idx) not in self.failed:  # stage 02 wrote it: gone since, a bad sample like any other
                self.skip(int(file_idx), "missing (deleted since stage 02 wrote it)")
            return None  # a row stage 02 could not extract: speculators skips it
        reason, t = load_sample(path, self.n_states, self.hidden)
        if reason:
            self.skip(int(file_idx), reason)
            return None
        states = t["hidden_states"]  # [T, L+1, H]
        if SCALES in t:  # fp8 on disk: the trainer sees the compute dtype
            import torch
            from hs_connectors.fp8_utils import dequantize_fp8_tensor
            states = dequantize_fp8_tensor(states, t[SCALES], dtype=getattr(torch, self.dtype))
        return {"hidden_states": states, "token_ids": t["token_ids"]}

    def get_generated(self, params):
        return None

    def delete(self, handle):
        pass  # stage 02's files are its own: training never deletes them

    def skip(self, i, reason):
        log.warning(f"hs_{i}.safetensors: {reason}; sample skipped")
        fd = outdir.open_append(self.skipped_log)
        try:
            os.write(fd, (json.dumps({"row": i, "reason": reason[:300], "time": time.time()}) + "\n").encode())
        finally:
            os.close(fd)
        with open(self.skipped_log, encoding="utf-8") as f:
            n = len({json.loads(line)["row"] for line in f if line.strip()})
        if n > max(1, MAX_BAD_SHARE * self.rows):
            raise RunError(f"--hidden-states {self.folder}: {n} of {self.rows} samples are bad (e.g. hs_{i}.safetensors: "
                           f"{reason}), more than {MAX_BAD_SHARE:.0%}; rerun {STAGE_SCRIPTS['extract']} (it redoes "
                           f"only those), then this command")


def skipped_rows(out):
    """How many samples CheckedFiles skipped in this folder's runs (logs/skipped.jsonl)."""
    try:
        with open(os.path.join(out, "logs", files.SKIPPED), encoding="utf-8") as f:
            return len({json.loads(line)["row"] for line in f if line.strip()})
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def install_checked(transfer):
    """Make `transfer` what speculators' loaders read offline, through its public registry."""
    from hs_connectors.transfer import HiddenStatesTransfer
    from .adapters import register_backend
    HiddenStatesTransfer.register(CheckedFiles)  # an ABC: ours is a virtual subclass
    _checked[0] = transfer
    register_backend(CHECKED, lambda: _checked[0])


_checked = [None]


class OfflineData:
    """Stage 02's files, entered around training like online.Session: rank 0 writes the training table, every rank
    waits for it and registers the checked transfer (each sample checked where it is read: CRC, dtype, finite
    values). `loaders()`: speculators' own; `summary()`: the samples skipped."""

    def __init__(self, args, ext, out, rank, rows, bridge, dtype):
        self.args, self.ext, self.out, self.rank, self.rows, self.bridge, self.dtype = \
            args, ext, out, rank, rows, bridge, dtype
        self.url = None

    def __enter__(self):
        if self.rank == 0:
            build_bridge(self.rows, self.bridge)
        wait_for_bridge(self.bridge)
        failed = {int(i) for i in self.ext.get("failures", {})}  # no file: stage 02 could not extract them
        install_checked(CheckedFiles(os.path.abspath(self.args.hidden_states), len(self.ext["layer_ids"]),
                                     self.ext["verifier"]["hidden_size"], os.path.join(self.out, "logs", files.SKIPPED),
                                     len(self.rows), self.dtype, failed))
        return self

    def __exit__(self, *exc):
        pass

    def loaders(self):
        return None

    def summary(self):
        return {"skipped_samples": skipped_rows(self.out)}


DEFAULT_RECIPE = {"draft_arch": "llama", "norm_before_fc": True, "fc_norm": False, "norm_output": True,
                  "loss_fn": "kl_div", "ttt_step_loss_decay": 1.0, "optimizer": "muon", "scheduler_type": "linear"}


def recipe(args, fp, text_cfg):
    """The draft's recipe as speculators' TrainConfig takes it (`args`: settings.Train; `fp`: the verifier's
    fingerprint; `text_cfg`: its language model's config). `--draft-arch auto`: the verifier's own family where there
    is a draft layer for it: the MLA layer for an MLA verifier (DeepSeek-V3, Kimi) whose rope transformers and vLLM
    compute alike, Qwen3's for Qwen3, else Llama's."""
    from . import mla_draft
    arch = args.draft_arch
    if arch == "auto" and mla_draft.is_mla(text_cfg):
        why = mla_draft.refusal(text_cfg)
        arch = "llama" if why else "deepseek"
        if why:
            log.warning(f"--draft-arch auto: a Llama-style draft, not the MLA one: {why}")
    elif arch == "auto":
        arch = "qwen3" if str(fp.get("model_type") or "").startswith("qwen3") else "llama"
    # the MLA draft's vLLM model has no norm before the FC layer (it has the per-state fc_norm)
    nbf = args.norm_before_fc if args.norm_before_fc is not None else not args.fc_norm and arch != "deepseek"
    return {"draft_arch": arch, "norm_before_fc": nbf, "fc_norm": args.fc_norm,
            "norm_output": args.norm_output, "loss_fn": args.loss_fn, "ttt_step_loss_decay": args.ttt_step_loss_decay,
            "optimizer": args.optimizer, "scheduler_type": args.scheduler}


def check_draft_arch(recipe_, text_cfg):
    """--draft-arch deepseek needs an MLA verifier whose rope transformers and vLLM compute alike (mla_draft)."""
    if recipe_["draft_arch"] != "deepseek":
        return
    from . import mla_draft
    why = None if mla_draft.is_mla(text_cfg) else "the verifier has no MLA attention (no kv_lora_rank in its config)"
    why = why or mla_draft.refusal(text_cfg)
    if why:
        raise UsageError(f"--draft-arch deepseek: {why}; use --draft-arch llama")
    if recipe_.get("norm_before_fc"):
        raise UsageError("--norm-before-fc: the MLA draft (--draft-arch deepseek, auto's choice for an MLA verifier) "
                         "has no norm before the FC layer in vLLM; use --fc-norm (a norm per state) or "
                         "--no-norm-before-fc, or --draft-arch llama")


def first_rows(args, rows, failed):
    """--num-samples N: the first N rows (row i stays hs_i, so stage 02's folder serves any N). -> (rows, failed)."""
    n = args.num_samples
    if n is None:
        return rows, failed
    if n > len(rows):
        raise UsageError(f"--num-samples {n}: --prepared-data {args.prepared_data} holds {len(rows)} rows; give at "
                         f"most {len(rows)}, or leave it out to train on all of them")
    return rows[:n], {i for i in failed if i < n}


def check_split(rows, val_ratio):
    """speculators splits the rows at int(rows x (1 - val_ratio)): both sides must hold a row."""
    cut = int(rows * (1 - val_ratio))
    if not 0 < cut < rows:
        raise UsageError(f"--val-ratio {val_ratio}: of {rows} rows it leaves {cut} to train on and {rows - cut} to "
                         f"validate; both need at least one (more rows, or another ratio)")


def check_draft_memory(num_layers, text_cfg, draft_vocab, on_gpu):
    """On a CPU, refuse a draft whose training state (float32 weights, gradients and two AdamW moments: 16 bytes a
    parameter, plus the verifier's frozen bf16 embedding) exceeds 90 % of the available RAM, before it is built."""
    if on_gpu:
        return
    from .compute import available_ram
    h = text_cfg["hidden_size"]
    inter = text_cfg.get("intermediate_size") or 4 * h
    trainable = num_layers * (4 * h * h + 3 * h * inter) + 3 * h * h + draft_vocab * h
    need = trainable * 16 + text_cfg["vocab_size"] * h * 2
    have = available_ram() * 0.9
    if need > have:
        raise UsageError(f"--num-layers {num_layers}: training this draft takes about {need / 1e9:.1f} GB, more than "
                         f"the {have / 1e9:.1f} GB of RAM available here; use fewer layers")


def _stored_ids(args, i):
    try:
        return read_token_ids(hs_path(args.hidden_states, i))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def build_bridge(rows, folder, engine_url=None):
    """Stage 01's rows as the Arrow table speculators' ArrowDataset reads. Row order is kept: row i <-> hs_i.
    Rows whose extraction failed stay in the table (their file is absent: speculators skips them). With --online the
    engine's URL goes beside it, for the other ranks. Built in `<folder>.new` (made and recorded here) and renamed."""
    import datasets
    ds = datasets.Dataset.from_dict({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows],
                                     "seq_len": [len(r[0]) for r in rows]})
    ds.set_format(type="torch")
    new = outdir.make_dir(folder + ".new")
    outdir.clear_scratch(new, DATASET_FILES)  # a killed run's half-built table
    ds.save_to_disk(new)
    with open(os.path.join(new, ".done"), "w") as f:  # a fresh file in a folder this stage just filled
        f.write(engine_url or "")
    outdir.record_tree(new)
    outdir.replace_dir(new, folder)


def wait_for_bridge(folder, timeout=600):
    """-> the engine URL rank 0 wrote (--online), else ''. Rank 0 may spend a long time starting the engine first."""
    deadline = time.time() + timeout
    while not os.path.exists(os.path.join(folder, ".done")):
        if time.time() > deadline:
            raise RuntimeError(f"rank 0 did not build {folder} in {timeout} s")
        time.sleep(0.5)
    with open(os.path.join(folder, ".done")) as f:
        return f.read().strip()


class DenseLog(logging.Handler):
    """One line every N steps from speculators' metric records: step/total, loss, per-position accuracy, lr,
    tok/s, ETA. Plain text, so it reads the same in a terminal and in a nohup log."""

    def __init__(self, every, total_steps=None, jsonl=None):
        super().__init__()
        self.every, self.total, self.t0, self.step0, self.tokens = every, total_steps, None, None, 0
        self.estimated = False
        self.fetch_ms = self.step_ms = 0.0  # the time the step waited for its batch, summed over the logged steps
        self.jsonl = jsonl  # every metric record, one JSON line each: stage 05 plots the training curves

    def emit(self, record):
        msg = record.msg
        if not isinstance(msg, dict) or not ("train" in msg or "val" in msg):
            return
        if self.jsonl:
            with os.fdopen(outdir.open_append(self.jsonl), "a", encoding="utf-8") as f:
                f.write(json.dumps(msg, default=float) + "\n")
        if "train" not in msg:
            return
        step = msg.get("global_step", 0) + 1
        if self.t0 is None:
            self.t0, self.step0 = time.time(), step - 1
        m, prof = msg["train"], msg.get("profile") or {}
        self.fetch_ms += prof.get("fetch_ms", 0.0)
        self.step_ms += prof.get("step_ms", 0.0)
        done = step - self.step0
        if done >= 4 and not self.estimated and self.total and self.total > step:  # timed after the first step
            self.estimated, rate = True, (time.time() - self.t0) / (done - 1)
            left = rate * (self.total - step)
            finish = time.strftime('%H:%M', time.localtime(time.time() + left))
            log.info(f"estimate from steps {self.step0 + 2}-{step} at {rate:.2f} s/step: the remaining "
                     f"{self.total - step} steps take about {max(1, round(left / 60))} min (done near {finish}), plus "
                     f"validation and checkpoints")
        if step % self.every and step != self.total:
            return
        acc = " ".join(f"{m[k]:.2f}" for k in sorted(k for k in m if "acc" in k and "full" in k)) or \
            " ".join(f"{m[k]:.2f}" for k in sorted(k for k in m if "acc" in k))
        rate = (time.time() - self.t0) / max(done - 1, 1)
        eta = f" ETA {int(rate * (self.total - step)) // 60}m{int(rate * (self.total - step)) % 60:02d}s" \
            if self.total else ""
        lr = msg.get("lr")
        lr = lr if isinstance(lr, (int, float)) else next(iter(lr.values()), 0) if isinstance(lr, dict) else 0
        total = f"/{self.total}" if self.total else ""
        log.info(f"step {step}{total} epoch {msg.get('epoch', 0)} loss {m.get('loss', float('nan')):.4f} "
                 f"acc[{acc}] lr {lr:.2e} {prof.get('tokens_per_s', 0):,.0f} tok/s data wait "
                 f"{prof.get('fetch_frac', 0):.0%}{eta}")

    @property
    def wait_fraction(self):
        return round(self.fetch_ms / self.step_ms, 4) if self.step_ms else None


TRAINING = [False]  # speculators' run_training is under way (its signal handler, or its interrupt save)


@contextlib.contextmanager
def acknowledged_signals(again_after=2.0):
    """A stop signal is answered at once with one line, even while the main thread is deep in a step (Python runs
    speculators' handler only when the step returns to the interpreter): the C-level wakeup fd hands each signal to
    a thread here. A second signal (more than `again_after` s later: torchrun and the loader workers resend the
    first) stops at once; the folder still resumes from its last complete checkpoint."""
    import signal
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: speculators' handler alone
        os.close(r)
        os.close(w)
        yield
        return

    def on_signal(signum, frame):
        """Ours while speculators' is not installed. Before training: stop now (nothing to save). During speculators'
        save of `interrupted` (it restores this one first): a quick second signal must not cut the save short; one
        more than `again_after` s later stops at once (the watcher)."""
        if not TRAINING[0]:
            raise KeyboardInterrupt
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def watch():
        first = None
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum not in (signal.SIGINT, signal.SIGTERM):
                    continue
                name = signal.Signals(signum).name
                if first is None:
                    first = time.time()
                    log.warning(f"{name}: stopping; an `interrupted` checkpoint is saved as soon as the step in progress "
                                f"lets go, and the same command resumes from it; send {name} again to stop at once")
                elif time.time() - first > again_after:
                    os.write(2, f"error: stopped at once by a second {name}; the same command resumes from the last "
                                f"complete checkpoint\n".encode())
                    os._exit(128 + signum)
    threading.Thread(target=watch, daemon=True, name="signal-watch").start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old)
        os.close(w)
        for s, h in handlers.items():
            signal.signal(s, h)


def make_trainer_class(dense_log, on_cpu, max_steps, measure=None):
    from speculators.train.trainer import Trainer

    class PipelineTrainer(Trainer):
        def setup_model(self):
            if on_cpu:
                self.local_rank, self.device_type = "cpu", "cpu"
            super().setup_model()
            from .input_watch import BatchGuard  # a batch of no token is named and counted, never trained on silently
            self.train_loader = BatchGuard(self.train_loader)
            if self.val_loader is not None:
                self.val_loader = BatchGuard(self.val_loader, "validation")
            steps = len(self.train_loader) * self.config.num_epochs
            dense_log.total = min(steps, max_steps) if max_steps else steps

        def train_epoch(self, epoch, **kw):
            if max_steps and self.global_step >= max_steps:
                return  # speculators would run one more step per remaining epoch
            return super().train_epoch(epoch, **kw)

        def run_training(self):
            TRAINING[0] = True
            # speculators 0.9 keeps looping over the remaining epochs after --max-steps, each one saving a
            # checkpoint and validating; stop at the epoch in which the last step falls
            if max_steps:
                need = -(-max_steps // max(1, len(self.train_loader)))
                self.config = self.config._replace(num_epochs=min(self.config.num_epochs, need))
            return super().run_training()

        def maybe_save_checkpoint(self, epoch, local_step=0):
            """speculators saves into STAGING/<epoch>; once complete it replaces <epoch> (a kill mid-save leaves the
            previous checkpoint whole), and the links are made here."""
            root = self.checkpointer.path
            staged = root / STAGING / str(epoch)
            if epoch != "interrupted":  # the inputs this run started from, still the same (input_watch)
                from .input_watch import check_training
                check_training()
            if self.rank == 0:
                outdir.make_dir(str(root / STAGING))
                discard_staged(str(staged))
                if epoch == "interrupted" and self.global_step == 0:
                    return  # nothing trained: nothing to resume from
                outdir.make_dir(str(staged))  # made here, a real folder: speculators writes into nothing else
            self.checkpointer.path = root / STAGING
            try:
                super().maybe_save_checkpoint(epoch, local_step)
            finally:
                self.checkpointer.path = root
            if self.rank == 0:  # speculators' readability link, made in STAGING: a kill must not leave it for --overwrite
                outdir.clear_scratch(str(root / STAGING), r"epoch\d+_(end|step\d+)")
            saved = (staged / "config.json").exists()
            if self.rank == 0 and saved:
                if epoch == "interrupted":  # speculators records no step for it: ours, so a rerun resumes from it
                    per_epoch = max(1, len(self.train_loader))
                    e, k = divmod(self.global_step, per_epoch)
                    e, k = (e - 1, 0) if k == 0 else (e, k)
                    files.write_json(str(staged / "training_state.json"),
                                     {"epoch": e, "local_step": k, "global_step": self.global_step})
                outdir.record_tree(str(staged))  # complete: a kill from here on leaves a save the rerun publishes
                from .mla_draft import write_served
                write_served(str(staged))  # an MLA draft: vllm/, the config vLLM 0.32 reads, beside the same weights
            if saved:
                from . import faults
                faults.kill_point("save")  # a reliability test: die with the save on disk but not in place
            if self.rank == 0 and not saved:
                discard_staged(str(staged))  # speculators chose not to save here: the empty folder goes
            elif self.rank == 0:
                publish(str(root), str(epoch), local_step)

        def maybe_update_best(self, epoch, val_metrics):
            """`checkpoint_best` -> the epoch whose draft has the highest acceptance length by the measure
            (validation_measure.py: what vLLM would count on the validation rows' first turns), or without it by the
            expected acceptance length on the validation rows (expected_acceptance); never the lowest loss: the two
            part ways late in training. Only an epoch that saved a checkpoint can be best (speculators' rule); the
            link and val_metrics.json are the stage's own files, written through outdir."""
            estimate = expected_acceptance(val_metrics)
            saved = (self.checkpointer.path / str(epoch) / "config.json").exists()  # this epoch has a checkpoint
            if estimate is None and measure is None:  # no per-position accuracies: speculators' own rule, by loss
                super().maybe_update_best(epoch, val_metrics)
            elif self.rank == 0 and saved:  # every checkpoint carries its figures (stage 05 ranks by them too)
                from .files import write_json
                record = {**val_metrics, "expected_acceptance_length": estimate}
                if measure is not None:
                    record["acceptance_measure"] = measure.score(self.model)
                write_json(str(self.checkpointer.path / str(epoch) / "val_metrics.json"), record)
                score = best_score(record, measured=measure is not None)[0]
                said = (f"acceptance length {score:.3f} by the measure ({measure.describe()}); the trainer's "
                        f"estimate {estimate or float('nan'):.3f} on the validation rows" if measure is not None else
                        f"expected acceptance length {score:.3f} on the validation rows")
                if score <= best_acceptance(self.checkpointer.path, skip=str(epoch), measured=measure is not None):
                    outdir.record(str(self.checkpointer.path / str(epoch) / "val_metrics.json"))
                    log.info(f"epoch {epoch}: {said}; checkpoint_best stays")
                    return
                outdir.symlink(str(epoch), str(self.checkpointer.path / "checkpoint_best"))
                self.best_val_loss = min(self.best_val_loss, val_metrics.get("loss_epoch", float("inf")))
                log.info(f"checkpoint_best -> {epoch}: {said} (loss {val_metrics.get('loss_epoch', float('nan')):.4f})")
            if self.rank == 0:
                for name in ("checkpoint_best", f"{epoch}/val_metrics.json"):
                    if os.path.lexists(self.checkpointer.path / name):
                        outdir.record(str(self.checkpointer.path / name))
    return PipelineTrainer


def expected_acceptance(val_metrics):
    """1 + a1 + a1*a2 + ...: the expected number of tokens a step yields (the verifier's own one, plus each draft
    token accepted while every one before it was), from speculators' per-position `full_acc_{k}_epoch` (already the
    product up to position k) on the validation rows. None without them."""
    if not isinstance(val_metrics, dict):
        return None
    ks = sorted(int(k[len("full_acc_"):-len("_epoch")]) for k in val_metrics
                if k.startswith("full_acc_") and k.endswith("_epoch") and k[len("full_acc_"):-len("_epoch")].isdigit())
    if not ks:
        return None
    return round(1 + sum(float(val_metrics[f"full_acc_{k}_epoch"]) for k in ks), 6)


def best_score(val_metrics, measured):
    """What `checkpoint_best` is chosen by: the measure's acceptance length when the run measures (a checkpoint
    saved without it, by an earlier run, scores -1 and is replaced), else the trainer's estimate. -> (score, name)."""
    if measured:
        got = (val_metrics.get("acceptance_measure") or {}).get("acceptance_length")
        return (-1.0 if got is None else float(got)), "measure"
    got = expected_acceptance(val_metrics)
    return (-1.0 if got is None else got), "estimate"


def best_acceptance(root, skip=None, measured=False):
    """The score (best_score) `checkpoint_best` was chosen for (-1 when there is none yet, or when it is the
    checkpoint `skip`, whose figures are being replaced)."""
    best = os.path.join(str(root), "checkpoint_best")
    if skip is not None and os.path.islink(best) and os.readlink(best) == skip:
        return -1.0
    try:
        with open(os.path.join(best, "val_metrics.json"), encoding="utf-8") as f:
            vm = json.load(f)
    except (OSError, ValueError):
        return -1.0
    return best_score(vm, measured)[0] if isinstance(vm, dict) else -1.0


def discard_staged(staged):
    """Free STAGING/<epoch> for a new save. What the record proves ours goes, and so do the files a save cut short
    left there under the names speculators saves (SAVE_FILES): the folder was made by this stage for that save alone
    (outdir.clear_scratch's rule). Anything else in it is kept: the folder is moved aside to
    STAGING/.cut-short-<epoch>-<time> and the log says so."""
    if not os.path.lexists(staged):
        return
    if not outdir.owned(staged):
        raise RunError(f"{outdir.quote(staged)}: not this stage's folder; move it away and rerun")
    outdir.clear_scratch(staged, SAVE_FILES)
    if not outdir.remove(staged):
        return
    aside = os.path.join(os.path.dirname(staged), f".cut-short-{os.path.basename(staged)}-{time.strftime('%Y%m%d-%H%M%S')}")
    outdir.move_aside(staged, aside)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(aside) for f in fs
               if not os.path.islink(os.path.join(d, f)))
    log.warning(f"a save cut short (a kill mid-save) left {len(os.listdir(aside))} entries, {size / 1e6:.0f} MB, that "
                f"no record proves this stage's: kept, moved to {outdir.quote(aside)}; delete it once checked")


def publish(root, epoch, local_step=0):
    """A complete save in STAGING/<epoch> becomes <epoch>: recorded, the previous <epoch> replaced (only if all of it
    is this stage's), then the `epoch{e}_{end|step}` and `last` links."""
    staged = os.path.join(root, STAGING, epoch)
    # speculators' own readability links (epoch{e}_end, made beside the staged save) point inside STAGING: ours
    # replace them
    outdir.clear_scratch(os.path.join(root, STAGING), r"epoch\d+_(end|step\d+)")
    outdir.record_tree(staged)
    outdir.replace_dir(staged, os.path.join(root, epoch))
    links = {"last": epoch}
    if epoch != "interrupted":
        links[f"epoch{epoch}_{f'step{local_step}' if local_step > 0 else 'end'}"] = epoch
        for name in os.listdir(root):  # the earlier link of this epoch
            if name.startswith(f"epoch{epoch}_") and name not in links and outdir.owned(os.path.join(root, name)):
                outdir.remove(os.path.join(root, name))
    for name, target in links.items():
        outdir.symlink(target, os.path.join(root, name))  # a stable pointer that is never missing


def resume_state(out):
    """Before speculators looks: a save killed mid-way is discarded (the previous checkpoint is whole), a complete one
    still in STAGING is published, and `interrupted/` (a Ctrl-C or SIGTERM) becomes the epoch it stopped in, so the
    rerun continues from the step it reached. -> a line saying which, or None."""
    staging = os.path.join(out, STAGING)
    said = None
    if outdir.owned(staging):
        for name in sorted(os.listdir(staging)):
            path = os.path.join(staging, name)
            if outdir.owned(path) and os.path.exists(os.path.join(path, "config.json")) and \
                    not outdir.remove(path, dry_run=True):  # complete: every file in it recorded
                publish(out, name)
            else:
                discard_staged(path)
    interrupted = os.path.join(out, "interrupted")
    state = os.path.join(interrupted, "training_state.json")
    if outdir.owned(state):
        with open(state) as f:
            st = json.load(f)
        epoch = str(st["epoch"])
        outdir.replace_dir(interrupted, os.path.join(out, epoch))
        outdir.remove(os.path.join(out, "last"))
        outdir.symlink(epoch, os.path.join(out, "last"))
        said = f"resuming from the interrupted checkpoint: epoch {st['epoch']}, step {st['global_step']}"
    for name in sorted(os.listdir(out)):  # speculators resumes from these: every file in them must be the one we wrote
        path = os.path.join(out, name)
        if (name.isdigit() or name == "interrupted") and outdir.owned(path):
            left = outdir.remove(path, dry_run=True)
            if left:
                raise UsageError(f"--output-dir {out}: {outdir.quote(os.path.relpath(left[0], out))} is not what this "
                                 f"stage wrote (a link, or a file put there), and speculators would resume from the "
                                 f"folder that holds it: move it away and rerun")
    return said


def print_serve_command(args, out, text_cfg, on_cpu, arch="llama"):
    """The checkpoint, and the command that serves it with the vLLM installed here (or why it cannot here)."""
    from .engine import eagle3_blocker, serve_command
    last = os.path.join(out, "last")
    log.info(f"checkpoint: {last} -> {os.path.realpath(last)}")
    blocker = eagle3_blocker(text_cfg, not on_cpu, mla_draft=arch == "deepseek")
    where = f" (on a GPU machine: {blocker})" if blocker else ""
    elsewhere = bool(blocker) or not on_cpu  # a GPU machine serves with vLLM's GPU build, installed here or not
    print(f"serve it{where}: {serve_command(args.model_path, last, args.ttt_steps, elsewhere, text_cfg)}")


def prepare_output(args, identity, inputs, rank, carry=lambda old: {}):
    """Rank 0 takes the folder (outdir.claim: only stage 04's own, the lock, --overwrite of exactly what earlier runs
    recorded) and resumes only with the same inputs. -> (the real output path, the manifest a finished earlier run
    left, or None)."""
    if rank != 0:
        return os.path.realpath(args.output_dir), None
    out, previous = files.take_output("--output-dir", args.output_dir, "train", identity, inputs,
                                      "checkpoints", overwrite=args.overwrite, carry=carry)
    said = resume_state(out)
    if said:
        log.info(said)
    return out, previous


DRAFT_LAYER = "draft_layer_config.json"  # an MLA draft's decoder-layer config, in the output folder


def write_draft_layer(out, recipe_, text_cfg, num_layers):
    """Rank 0, before the data bridge the other ranks wait for: the MLA draft's layer config speculators builds it
    from (mla_draft.layer_config)."""
    if recipe_["draft_arch"] == "deepseek":
        from . import mla_draft
        files.write_json(os.path.join(out, DRAFT_LAYER), mla_draft.layer_config(text_cfg, num_layers))


def train_config(args, bridge, aux_layer_ids, on_cpu, draft_vocab, storage="bf16", engine_url=None, dtype="bfloat16",
                 recipe_=None):
    """speculators' TrainConfig. `dtype` (compute.py) is its hidden_states_dtype: the loader's states and autocast.
    float32 turns autocast off (it knows only bf16/fp16) and the draft, whose master weights speculators keeps in
    float32 anyway, computes in float32; the checkpoint is saved bf16 either way."""
    from speculators.train.config import TrainConfig
    # GPU: up to 12 workers per rank (speculators' default) but no more than the cores each rank has: reading
    # per-sample files is most of a step's input cost. CPU: none, the training step already uses every core.
    per_rank = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    workers = args.num_workers if args.num_workers is not None else (0 if on_cpu else max(1, min(12, per_rank - 1)))
    if args.online and args.num_workers is None:  # a worker mostly waits for the engine: one runs ahead even on CPU
        workers = max(workers, 1) if on_cpu else min(workers, 4)
    flat = {
        "speculator_type": "eagle3", "verifier_name_or_path": args.model_path,
        "trust_remote_code": args.trust_remote_code, "num_layers": args.num_layers, "ttt_steps": args.ttt_steps,
        "target_layer_ids": aux_layer_ids,
        "d2t_path": os.path.join(args.vocab_mapping, "d2t.npy"), "t2d_path": os.path.join(args.vocab_mapping, "t2d.npy"),
        "draft_vocab_size": None, "data_path": bridge, "hidden_states_path": os.path.abspath(args.hidden_states),
        "hidden_states_backend": CHECKED,  # each sample checked where read (CheckedFiles); fp8 dequantized there
        "on_missing": "skip", "total_seq_len": args.total_seq_len, "train_data_ratio": 1 - args.val_ratio,
        "num_workers": workers, "prefetch_factor": 4, "epochs": args.epochs, "lr": args.lr,
        "max_steps": args.max_steps, "scheduler_warmup_steps": args.warmup_steps,
        "checkpoint_freq": args.checkpoint_freq, "log_freq": args.log_every, "save_path": os.path.abspath(args.output_dir),
        "log_dir": os.path.join(os.path.abspath(args.output_dir), "logs"), "seed": args.seed, "fsdp_shard": args.fsdp,
        "logger": "", "hidden_states_dtype": dtype,
    }
    if args.online:  # speculators' on-demand generation, through our transfer (online.py): cache first, then the engine
        from .sample_cache import BACKEND, CACHE
        flat.update(hidden_states_backend=BACKEND, hidden_states_path=os.path.join(os.path.abspath(args.output_dir),
                    CACHE), on_missing="generate", vllm_endpoint=engine_url, generation_validation_retries=1,
                    request_timeout=600.0, prefetch_factor=2)
    if on_cpu:  # no Triton driver, no flex attention: torch's sdpa
        flat.update(draft_attn_impl="sdpa")
    flat.update(recipe_ or DEFAULT_RECIPE)
    if flat["draft_arch"] == "deepseek":  # speculators' public draft_config: the MLA layer's (write_draft_layer)
        flat.update(draft_config=os.path.join(os.path.abspath(args.output_dir), DRAFT_LAYER), draft_arch=None)
    flat["loss_implementation"] = choose_loss(args.loss_implementation, on_cpu, draft_vocab, args.ttt_steps,
                                              flat["loss_fn"])
    return TrainConfig.from_flat(flat)


def choose_loss(requested, on_cpu, draft_vocab, ttt_steps, loss_fn="kl_div"):
    """speculators' loss implementation. `auto`: its Triton-fused loss where it compiles, else the eager one. On CPU
    there is no Triton driver. On GPU the fused loss runs inside the draft's compiled forward, and some torch versions
    fail to compile it ("ListVariable(...) is already tracked for mutation" on torch 2.11, after two minutes of
    compiling): a probe compiles the same loss on the real draft vocabulary first, and its answer is logged."""
    if requested != "auto":
        return requested
    if on_cpu:
        return "eager"
    t0 = time.time()
    why = fused_loss_fails(draft_vocab, ttt_steps, loss_fn)
    if why:
        log.info(f"loss implementation: eager (speculators' fused Triton loss does not compile here: {why}; probe "
                 f"{time.time() - t0:.0f} s)")
        return "eager"
    log.info(f"loss implementation: fused (the probe compiled and ran it in {time.time() - t0:.0f} s)")
    return "fused"


def fused_loss_fails(draft_vocab, ttt_steps, loss_fn="kl_div", tokens=256):
    """Compile speculators' fused loss as the draft's forward uses it (every TTT step's loss and metrics in one
    torch.compile graph) and run forward and backward once on [1, tokens, draft_vocab] logits. None when it works,
    else the error's first line."""
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.metrics import compute_metrics
    cfg = resolve_loss_config(loss_fn, "fused")

    @torch.compile
    def loss_of(logits, targets, mask):
        prev = torch.ones(mask.shape, dtype=torch.bool, device=mask.device)
        total, metrics = 0, {}
        for step in range(ttt_steps):
            loss, m = compute_metrics(logits, targets, mask, prev, step, 1.0, loss_config=cfg)
            total, metrics = total + loss, {**metrics, **m}
        return total, metrics
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(1, tokens, draft_vocab, device="cuda", generator=g, requires_grad=True)
        targets = torch.randn(1, tokens, draft_vocab, device="cuda", generator=g)
        mask = torch.ones(1, tokens, dtype=torch.bool, device="cuda")
        total, _ = loss_of(logits, targets, mask)
        total.backward()
        torch.cuda.synchronize()
        return None if torch.isfinite(logits.grad).all() else "non-finite gradient"
    except Exception as e:  # any failure to compile or run means: not here
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    finally:
        torch._dynamo.reset()


def run(cfg, args, on_cpu, dtype="bfloat16", loaders=None, measure=None):
    """speculators' own training entry point, with our Trainer subclass and dense log attached (adapters.py, for the
    run only); `dtype` the compute dtype (train_config's); `loaders`: a context that adapts speculators' data loaders
    for the run (online.loaders), or None; `measure`: validation_measure.Measure choosing checkpoint_best, or None
    (the trainer's estimate chooses it)."""
    from . import adapters, lifeline
    import warnings
    lifeline.start()  # data-loader and compile workers die with the stage too, however it ends
    warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator.*")
    # float32 compute: autocast says it does not know float32 and turns itself off, which is the point
    warnings.filterwarnings("ignore", message=".*autocast.*(not supported|only supports).*")
    logs = outdir.make_dir(os.path.join(os.path.abspath(args.output_dir), "logs"))
    if int(os.environ.get("RANK", "0")) == 0:
        os.close(outdir.open_append(os.path.join(logs, "metrics.jsonl")))  # refused now, not after an epoch
    dense = DenseLog(every=1, total_steps=args.max_steps, jsonl=os.path.join(logs, "metrics.jsonl"))
    trainer_cls = make_trainer_class(dense, on_cpu, args.max_steps, measure)
    holder = {}

    class Recording(trainer_cls):
        def setup_trainer(self):
            super().setup_trainer()
            holder["start_step"] = self.global_step

        def setup_model(self):
            holder["trainer"] = self
            super().setup_model()
    with contextlib.ExitStack() as stack:
        scli = stack.enter_context(adapters.speculators_entry(
            Recording, dense if int(os.environ.get("RANK", "0")) == 0 else None, own_metric_lines=False))
        if on_cpu:
            stack.enter_context(adapters.cpu_without_accelerator())
        if loaders is not None:
            stack.enter_context(loaders)
        for ctx in (adapters.muon_in_float32(dtype), adapters.recorded_artifacts(type(cfg)), adapters.mla_draft_layer(),
                    acknowledged_signals()):
            stack.enter_context(ctx)
        scli.main(cfg)
    t = holder.get("trainer")
    path = t.checkpointer.path if t else None
    real = lambda name: os.path.realpath(path / name) if path and (path / name).exists() else None  # noqa: E731
    return {"steps": t.global_step if t else 0, "steps_this_run": (t.global_step - holder.get("start_step", 0)) if t else 0,
            "checkpoint_last": real("last"),
            "checkpoint_best": real("checkpoint_best"), "best_val_loss": getattr(t, "best_val_loss", None),
            "best_expected_acceptance": max(best_acceptance(path), 0) or None if path else None,
            "best_acceptance_measure": (max(best_acceptance(path, measured=True), 0) or None) if path and measure
            else None,
            "data_wait_fraction": dense.wait_fraction}
