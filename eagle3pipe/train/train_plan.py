"""Stage 04's preflight and its run identity, in seconds and without torch: the device and the loss implementation it
can run, every size and step count against the device, the data and the memory, the disk the checkpoints take, and
whether an earlier run in --output-dir is the same run (resumed) or another (refused, naming every setting that
differs, unless --overwrite restarts it)."""
import dataclasses
import logging
import os

from . import target_check
from .. import adapters
from ..base import compile_cache, compute, devices
from ..base.devices import available_ram, visible_gpus
from ..base.errors import UsageError
from ..storage import files, input_watch, outdir
from ..verifier import verifier
from ..verifier.verifier_weights import say, verify
from ..verifier.vllm_support import eagle3_refusal

log = logging.getLogger("eagle3")

# EAGLE-3's acceptance decays with the position (each draft token is accepted only if every one before it was), so
# positions past ~10 add almost nothing to the expected acceptance length, while each TTT step costs one more draft
# forward and backward whose attention spans every earlier step (time and memory grow with steps x tokens: 100,000
# steps never finish the first one). vLLM serves the draft with as many speculative tokens as it was trained for.
MAX_TTT_STEPS = 16
MAX_EPOCHS = 1000  # passes over the same rows beyond this only overfit; --max-steps bounds a long run
MIN_CHECKPOINT_FREQ = 0.01  # at most 100 saves an epoch: each one writes the whole draft and its optimizer state
# a trainable parameter's optimizer state in a checkpoint: AdamW's two float32 moments; Muon's one momentum buffer
# (measured: 10 MB for the SmolLM2 draft's 6.2 M trainable parameters)
OPTIMIZER_BYTES = {"adamw": 8, "muon": 2}


@dataclasses.dataclass(frozen=True)
class Device:
    gpus: list          # [(name, total bytes)] nvidia-smi lists for this process
    on_gpu: bool        # what training will run on, as far as can be known without torch

    @property
    def memory(self):
        """Bytes one training process may fill: its GPU's (the smallest), or 90 % of the available RAM."""
        return min(t for _, t in self.gpus) if self.on_gpu else int(available_ram() * 0.9)

    @property
    def where(self):
        return f"the {self.gpus[0][0]}'s {self.memory / 1e9:.1f} GB" if self.on_gpu else \
            f"the {self.memory / 1e9:.1f} GB of RAM available here"


def check_device(s):
    """--device, --loss-implementation, --fsdp and --num-workers against this machine and launch (one nvidia-smi
    call, no torch)."""
    gpus = visible_gpus()
    if s.device == "cuda" and not gpus:
        cvd = devices.visible_setting()
        where = f" ({devices.VISIBLE}={cvd!r})" if cvd is not None else ""
        raise UsageError(f"--device cuda: no GPU visible here{where}; nvidia-smi lists none: use --device cpu or auto")
    on_gpu = s.device == "cuda" or (s.device == "auto" and bool(gpus))
    if s.loss_implementation == "fused" and not on_gpu:
        raise UsageError("--loss-implementation fused: speculators' fused loss is a Triton kernel, which needs a GPU; "
                         "training here runs on the CPU: use auto or eager")
    if s.fsdp and not devices.under_torchrun():  # speculators' own check comes after the data is bridged, exit 1
        raise UsageError("--fsdp: shards the draft across the ranks of a torchrun launch, and this process was not "
                         "started by torchrun (no LOCAL_RANK): launch with `torchrun --nproc-per-node N 04_train.py "
                         "...`, or drop --fsdp")
    cores = devices.cores()
    if s.num_workers is not None and s.num_workers > 2 * cores:
        raise UsageError(f"--num-workers {s.num_workers}: more than twice the {cores} CPU cores this process may use; "
                         f"each worker is a process holding batches in memory, and more than the cores only contend "
                         f"(default: none on CPU, up to 12 per GPU)")
    return Device(gpus, on_gpu)


def draft_params(text_cfg, num_layers, draft_vocab):
    """(trainable parameters, frozen embedding parameters) of an EAGLE-3 draft on this verifier: decoder layers, the
    FC over the auxiliary states, the draft's LM head; the verifier's embedding is copied in, frozen."""
    h = text_cfg["hidden_size"]
    inter = text_cfg.get("intermediate_size") or 4 * h
    return num_layers * (4 * h * h + 3 * h * inter) + 3 * h * h + draft_vocab * h, text_cfg["vocab_size"] * h


def checkpoint_bytes(text_cfg, num_layers, draft_vocab, optimizer="adamw"):
    """One checkpoint: the draft saved bf16 (its frozen embedding included) and its optimizer state."""
    trainable, frozen = draft_params(text_cfg, num_layers, draft_vocab)
    return (trainable + frozen) * 2 + trainable * OPTIMIZER_BYTES[optimizer]


def saved_epochs(epochs, checkpoint_freq):
    """How many epoch folders a run keeps: every epoch with a mid-epoch frequency, else epoch 0 and every epoch e
    with (e + 1) % freq == 0 (speculators' rule)."""
    if checkpoint_freq < 1:
        return epochs
    return 1 + sum(1 for e in range(1, epochs) if (e + 1) % int(checkpoint_freq) == 0)


def check_sizes(s, text_cfg, rows, n_states, draft_vocab, device, dtype):
    """Sizes and step counts against the data and the memory: -> nothing, or one line naming the flag."""
    if s.ttt_steps > MAX_TTT_STEPS:
        raise UsageError(f"--ttt-steps {s.ttt_steps}: at most {MAX_TTT_STEPS}; each step is one more draft forward "
                         f"and backward over every earlier step (time and memory grow with it), and acceptance decays "
                         f"with the position, so tokens past ~10 are almost never accepted (speculators' default: 3)")
    if s.epochs > MAX_EPOCHS:
        raise UsageError(f"--epochs {s.epochs}: at most {MAX_EPOCHS}; that many passes over the same rows only "
                         f"overfit (bound a long run with --max-steps)")
    if s.checkpoint_freq >= 1:
        if s.checkpoint_freq != int(s.checkpoint_freq):
            raise UsageError(f"--checkpoint-freq {s.checkpoint_freq}: from 1 up, a whole number of epochs (below 1: "
                             f"a fraction of an epoch)")
        if s.epochs > 1 and s.epochs % int(s.checkpoint_freq):
            raise UsageError(f"--checkpoint-freq {s.checkpoint_freq:g} with --epochs {s.epochs}: the last epoch would "
                             f"not be saved (a checkpoint every {s.checkpoint_freq:g} epochs); give --epochs a "
                             f"multiple of it")
    elif s.checkpoint_freq < MIN_CHECKPOINT_FREQ:
        raise UsageError(f"--checkpoint-freq {s.checkpoint_freq}: at least {MIN_CHECKPOINT_FREQ} (100 saves an "
                         f"epoch); each save writes the whole draft and its optimizer state")
    lengths = [len(r[0]) for r in rows]
    tokens, longest = sum(lengths), max(lengths)
    if longest > s.total_seq_len:
        raise UsageError(f"--total-seq-len {s.total_seq_len}: shorter than the longest row ({longest} tokens); "
                         f"raise it")
    # a lower bound of one step's memory: the batch's states, each TTT step's draft logits and the targets, plus the
    # draft's training state (float32 weights, gradients, two moments) and the verifier's embedding and head
    value = 4 if dtype == "float32" else 2
    per_token = n_states * text_cfg["hidden_size"] * value + (s.ttt_steps + 1) * draft_vocab * 2
    trainable, frozen = draft_params(text_cfg, s.num_layers, draft_vocab)
    fixed = trainable * 16 + frozen * 2 * (1 if text_cfg.get("tie_word_embeddings") is not False else 2)
    need = fixed + s.total_seq_len * per_token
    if need > device.memory:
        fit = max(0, (device.memory - fixed) // per_token)
        raise UsageError(f"--total-seq-len {s.total_seq_len}: one step needs at least {need / 1e9:,.1f} GB ({per_token:,} "
                         f"B a token for the states and {s.ttt_steps + 1} logits of {draft_vocab:,}, plus the draft's "
                         f"state), more than {device.where}; use at most {fit:,} (the longest row needs {longest})")
    if s.total_seq_len > max(tokens, longest):  # it trains (a smoke test on a few rows), on padding mostly
        logging.getLogger("eagle3").warning(
            f"--total-seq-len {s.total_seq_len}: more than all {tokens:,} tokens of --prepared-data; every batch is "
            f"padded to it, so most of each step is padding: {tokens:,} or less would do (the longest row needs "
            f"{longest})")
    train_rows = int(len(rows) * (1 - s.val_ratio))
    most_steps = s.max_steps or train_rows * s.epochs  # a batch holds at least one row
    if s.warmup_steps is not None and s.warmup_steps >= most_steps:
        raise UsageError(f"--warmup-steps {s.warmup_steps}: the run takes at most {most_steps:,} steps ("
                         f"{'--max-steps' if s.max_steps else f'{train_rows} training rows x {s.epochs} epochs'}), so "
                         f"the learning rate would never reach --lr; use fewer")
    fewest = s.max_steps or max(1, -(-int(tokens * (1 - s.val_ratio)) // s.total_seq_len)) * s.epochs
    if s.warmup_steps is not None and s.warmup_steps >= fewest:  # rows packed --total-seq-len tokens a step
        logging.getLogger("eagle3").warning(
            f"--warmup-steps {s.warmup_steps}: the run may take as few as {fewest:,} steps (its rows packed "
            f"{s.total_seq_len:,} tokens a step), and then the learning rate never reaches --lr")


def tree_bytes(path):
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(path) for f in fs)


def check_disk(s, text_cfg, draft_vocab, tokens):
    """The checkpoints the run keeps (one per saved epoch, one more being saved into .saving/, and an `interrupted`
    one), the data table and an --online cache, against the free space of --output-dir; checkpoints already there
    count as written (a resumed run replaces them)."""
    one = checkpoint_bytes(text_cfg, s.num_layers, draft_vocab, s.optimizer)
    epochs = s.epochs
    if s.max_steps:  # speculators stops at the epoch the last step falls in; an epoch takes at least this many steps
        per_epoch = max(1, -(-int(tokens * (1 - s.val_ratio)) // s.total_seq_len))
        epochs = min(epochs, -(-s.max_steps // per_epoch))
    kept = saved_epochs(epochs, s.checkpoint_freq) + 2
    need = one * kept + tokens * 32 + int(s.cache_gb * 1e9)
    have = 0
    if os.path.isdir(s.output_dir) and not s.overwrite:
        have = sum(tree_bytes(os.path.join(s.output_dir, n)) for n in os.listdir(s.output_dir)
                   if (n.isdigit() or n == "interrupted") and not os.path.islink(os.path.join(s.output_dir, n)))
    free = files.free_bytes(s.output_dir)
    if need - have > free:
        cache = f" and the {s.cache_gb:g} GB --cache-gb" if s.cache_gb else ""
        raise UsageError(f"--output-dir {s.output_dir}: needs about {(need - have) / 1e9:.2f} GB more ({kept} "
                         f"checkpoints of {one / 1e9:.2f} GB{cache}), {free / 1e9:.2f} GB free; free space, choose "
                         f"another folder, or save fewer epochs (--checkpoint-freq)")


# ------------------------------------------------------------------------------------------------- run identity

# a setting that changes what is trained: the same run resumes only with the same value. --epochs and --max-steps
# are not: more epochs continue the same run (same rows, split, batches and optimizer; the schedule is stretched to
# the new end), fewer stop it earlier. Device, workers and logging change how, not what. The compute dtype changes
# what: the weights and the optimizer's states are computed (and rounded) in it, so it is part of the identity as
# resolved (compute.resolve), not as typed: `--dtype auto` that resolves to the same dtype resumes.
DATA = {"prepared": "--prepared-data", "extract": "--hidden-states", "vocab": "--vocab-mapping"}
SETTINGS = ("num_layers", "ttt_steps", "total_seq_len", "lr", "warmup_steps", "val_ratio", "seed")


def run_identity(s, prep, ext, voc, recipe, dtype):
    """What makes two runs the same: the inputs' content ids, the sizes, the optimizer's settings, the split, the
    draft's recipe (training.recipe, resolved) and the compute dtype `dtype` (compute.resolve(...).dtype)."""
    return {"prepared": prep["content_id"], "extract": ext.content_id, "vocab": voc["content_id"],
            **{k: getattr(s, k) for k in SETTINGS}, "dtype": dtype, "recipe": dict(recipe),
            # only when given: runs recorded before the flag existed trained on every row and resume as they were
            **({"num_samples": s.num_samples} if s.num_samples is not None else {})}


def _flat(identity):
    out = {}
    for k, v in (identity or {}).items():
        if k == "recipe" and isinstance(v, dict):
            out.update({("--scheduler" if r == "scheduler_type" else "--" + r.replace("_", "-")): x
                        for r, x in v.items()})
        elif k in DATA:
            out[f"{DATA[k]} (its content id)"] = v
        else:
            out["--" + k.replace("_", "-")] = v
    return out


def earlier_record(folder):
    """The run record (files.RUN_FILE) an earlier run left in `folder`, or its manifest for folders finished before
    run records existed; None for a new or empty folder."""
    if not os.path.isdir(folder):
        return None
    run_file = os.path.join(folder, files.RUN_FILE)
    old = files.read_json(run_file) if os.path.lexists(run_file) else files.read_manifest(folder)
    if old is not None and not isinstance(old, dict):
        raise UsageError(f"{run_file}: expected a JSON object; use --overwrite or another folder")
    return old


def check_resume(s, identity):
    """An earlier run in --output-dir resumes only if it is the same run: else one line naming every setting that
    differs (old -> new). -> the earlier run's record (None if there is none, or with --overwrite)."""
    if s.overwrite:
        return None
    old = earlier_record(s.output_dir)
    if old is None:
        return None
    mine = old.get("identity", old)
    if mine == identity:
        moved = [f"--{k.replace('_', '-')} {old[k]} -> {v}" for k, v in horizon(s).items() if k in old and old[k] != v]
        if moved:
            log.info(f"continuing the same run with {', '.join(moved)} (the learning-rate schedule ends at the new "
                     f"end)")
        return old
    was, now = _flat(mine if isinstance(mine, dict) else {}), _flat(identity)
    diffs = [f"{k} {was.get(k, '(not recorded)')} -> {v}" for k, v in now.items() if was.get(k, KeyError) != v]
    diffs += [f"{k} {v} -> (none)" for k, v in was.items() if k not in now]
    raise UsageError(f"--output-dir {s.output_dir}: holds a run with other settings ({'; '.join(diffs) or 'identity'}); "
                     f"the same run resumes only with the same settings: give those, or add --overwrite to restart "
                     f"it cleanly (its checkpoints are deleted)")


def horizon(s):
    """Recorded beside the identity: what the run was asked to reach (a rerun may extend it)."""
    return {"epochs": s.epochs, "max_steps": s.max_steps}


def memory_hint(s, rows, on_gpu, online):
    """What an out-of-memory line advises beyond freeing memory (errors.MEMORY), by what ran out. A step's memory
    grows with --total-seq-len (its floor: the longest row) and --ttt-steps; a new value of either starts over, since
    the run's identity holds it and a resume would refuse it."""
    longest = int(rows.lengths().max())
    over = "and start over with --overwrite or another --output-dir"
    step = (f"lower --total-seq-len ({s.total_seq_len:,} now; the longest row needs {longest:,}) {over}"
            if s.total_seq_len > longest else
            f"shorten the rows (stage 01's --max-seq-len: --total-seq-len {s.total_seq_len:,} is already the longest "
            f"row's) or use fewer --ttt-steps ({s.ttt_steps} now), {over}")
    if not on_gpu:
        return {"host": step}
    engine = "; or give the engine less (--engine-memory) or GPUs of its own (--engine-gpus)" if online else ""
    return {"gpu": step + engine, "host": "lower --num-workers (each loader worker holds batches in memory)"}


# ------------------------------------------------------------------------------------------------- the whole plan

@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything stage 04 checked before anything loads (plan()); `states`: the online engine's plan, or None."""
    device: Device
    verifier: dict
    text_cfg: dict
    recipe: dict
    inputs: list
    prep: dict
    ext: object  # train_data.States: stage 02's folder or the online engine's states
    voc: dict
    rows: list
    failed: set
    dtype: object
    states: object
    identity: dict
    watch: object
    targets: object = None  # target_check.Verdict: the training targets against the verifier's own (offline runs)

    @property
    def aux(self):
        return self.ext.aux  # the draft's inputs; the last id (n) is the verifier's last hidden state

    @property
    def draft_vocab(self):
        return self.voc["counts"]["draft_vocab_size"]


def plan(s, rank):
    """Every check of stage 04, in seconds, before torch or any model loads: the device, the verifier and the draft's
    recipe (what the installed speculators and vLLM can train and serve), the output folder, the three inputs
    against each other, the rows, split, sizes, memory and disk, the online engine, and the run's identity against
    an earlier run in the folder. -> Plan."""
    from . import online_plan, train_data, training  # here, not at the top: they import numpy
    device = check_device(s)  # --device, --loss-implementation, --num-workers
    fp, tc = verifier.open_verifier(s.model_path, s.trust_remote_code)
    adapters.check_private("speculators")  # the private names adapters.py relies on, before torch loads
    recipe = training.recipe(s, fp, tc)
    training.check_draft_arch(recipe, tc, s.model_path)
    adapters.check_serves(recipe)  # an option the installed vLLM cannot serve: refused now, not after training
    unserved = eagle3_refusal(fp.get("architecture"))
    if unserved and rank == 0:  # another vLLM may have it: said before training, not after
        log.warning(f"{unserved}; the draft trains, but stage 05 and vLLM here will refuse it")
    verifier.check_draft_sources(s.model_path, tied=tc.get("tie_word_embeddings") is not False)
    inputs = [("--model-path", s.model_path), ("--prepared-data", s.prepared_data),
              ("--vocab-mapping", s.vocab_mapping)] + ([] if s.online else [("--hidden-states", s.hidden_states)])
    if rank == 0:
        outdir.check("--output-dir", s.output_dir, "train", inputs)
    layer_ids = verifier.resolve_layer_ids(s.layer_ids, fp["num_hidden_layers"]) if s.online else None
    # rank 0 reads every file against its checksum; the other ranks wait for its bridge
    prep, ext, voc, rows, failed = train_data.check_inputs(s, fp, verify_data=rank == 0 and s.verify_data,
                                                           online_layer_ids=layer_ids)
    rows, failed = train_data.first_rows(s, rows, failed)  # --num-samples
    train_data.check_split(len(rows), s.val_ratio, failed, s.hidden_states)
    draft_vocab = voc["counts"]["draft_vocab_size"]
    training.check_draft_memory(s.num_layers, tc, draft_vocab, device.on_gpu)
    dtype = compute.resolve(s.dtype, device.on_gpu)
    check_sizes(s, tc, rows, len(ext.layer_ids), draft_vocab, device, dtype.dtype)
    if rank == 0:
        check_disk(s, tc, draft_vocab, sum(len(r[0]) for r in rows))
    # the engine, its GPUs and port
    states = online_plan.plan(s, fp, tc, max(len(r[0]) for r in rows), layer_ids) if s.online else None
    if states and states.trainer_cvd:
        devices.set_visible(os.environ, states.trainer_cvd)  # training keeps off the engine's GPUs
    identity = run_identity(s, prep, ext, voc, recipe, dtype.dtype)
    if rank == 0:  # an earlier run here resumes only if it is this run: else every differing setting, in one line
        check_resume(s, identity)
    watch = input_watch.stage04_inputs(s, prep, ext, voc)
    input_watch.watch_training(watch)  # re-checked at each checkpoint, and before the manifest
    # the last check (it imports transformers): the weights against the config; said once the folder is taken
    verify(s.model_path, s.trust_remote_code)  # (confirm_device)
    # the targets speculators will train toward against the verifier's own distribution, on a few stored rows
    targets = None if s.online else target_check.check(s, tc, ext, rows, failed, recipe["draft_arch"])
    return Plan(device, fp, tc, recipe, inputs, prep, ext, voc, rows, failed, dtype, states, identity, watch, targets)


def confirm_device(s, p, rank):
    """Once torch is imported: where training runs and its compute dtype, said first (torch may see no GPU where
    nvidia-smi saw one: then the CPU's dtype). -> (on_cpu, compute.Resolved)."""
    import torch
    on_cpu = s.device == "cpu" or (s.device == "auto" and torch.accelerator.current_accelerator() is None)
    dtype = compute.resolve(s.dtype, not on_cpu)
    if rank == 0:  # the first lines once every check has passed: the verifier's weights, the compute dtype and why
        say(s.model_path, s.trust_remote_code)
        if p.targets is not None:
            log.info(p.targets.describe())
        log.info(dtype.describe())
        if dtype.warning:
            log.warning(dtype.warning)
    if not on_cpu:  # on a GPU speculators compiles the draft's step. Chosen before torch._dynamo is imported (by
        where, kept = compile_cache.prepare()  # speculators): that import writes torch's default, in /tmp, into it
        if rank == 0:
            log.info(f"torch.compile cache: {where}" + (" (a rerun, a resume or another run here reuses it)" if kept
                                                        else ""))
    return on_cpu, dtype
