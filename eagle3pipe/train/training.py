"""Stage 04's trainer: speculators' own, with the draft's recipe, its TrainConfig, a CPU compatibility layer,
signals answered at once, and the Trainer subclass whose saves and `checkpoint_best` are
checkpoints.py's. The data it reads is train_data.py's; its dense log line is train_log.py's.

The training itself is speculators' (`speculators.train.cli.main`: Eagle3 draft built from the verifier's
config, packed batches, TTT steps, checkpoints with mid-epoch resume, DDP/FSDP under torchrun).
"""
import contextlib
import logging
import os
import signal
import threading
import time
import warnings

from . import checkpoints, train_data, warm_start
from .. import adapters
from ..base import devices, lifeline
from ..base.devices import available_ram
from ..base.errors import UsageError
from ..base.inherited import last_words
from ..drafts import archs
from ..storage import files, outdir
from ..storage.input_watch import BatchGuard
from .sample_cache import BACKEND, CACHE
from .step_profile import StepProfile
from .train_log import DenseLog


log = logging.getLogger("eagle3")




DEFAULT_RECIPE = {"draft_arch": "llama", "norm_before_fc": True, "fc_norm": False, "norm_output": True,
                  "loss_fn": "kl_div", "ttt_step_loss_decay": 1.0, "optimizer": "muon", "scheduler_type": "linear"}


def recipe(args, fp, text_cfg):
    """The draft's recipe as speculators' TrainConfig takes it (`args`: settings.Train; `fp`: the verifier's
    fingerprint; `text_cfg`: its language model's config). `--draft-arch auto`: the verifier's own family where there
    is a draft layer for it: the MLA layer for an MLA verifier (DeepSeek-V3, Kimi) whose rope transformers and vLLM
    compute alike, Qwen3's for Qwen3, else Llama's."""
    name = args.draft_arch
    if name == "auto":
        arch, why = archs.auto(fp, text_cfg)
        name = arch.name
        if why:
            log.warning(f"--draft-arch auto: {why}")
    nbf = args.norm_before_fc
    if nbf is None:  # on unless the per-state fc_norm replaces it or the layer has none (vLLM's MLA draft)
        nbf = not args.fc_norm and archs.ARCHS[name].norm_before_fc
    return {"draft_arch": name, "norm_before_fc": nbf, "fc_norm": args.fc_norm,
            "norm_output": args.norm_output, "loss_fn": args.loss_fn, "ttt_step_loss_decay": args.ttt_step_loss_decay,
            "optimizer": args.optimizer, "scheduler_type": args.scheduler}


def rope_misfit(text_cfg):
    """Why speculators cannot build a Llama-style draft's rope from the verifier's, or None. It gives the draft the
    verifier's rope settings over the whole head, without partial_rotary_factor: per-dimension factor lists sized for
    a partial rotary (Phi-4-mini's longrope: 12 for 16) failed inside speculators after the data was read."""
    rope = text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling")
    if not isinstance(rope, dict) or "mrope_section" in rope:  # speculators keeps partial rotary for MRoPE
        return None
    heads = text_cfg.get("num_attention_heads")
    head = text_cfg.get("head_dim") or (text_cfg.get("hidden_size", 0) // heads if heads else 0)
    for key, value in sorted(rope.items()):
        if isinstance(value, list) and key.endswith("_factor") and head and len(value) != head // 2:
            factor = rope.get("partial_rotary_factor", text_cfg.get("partial_rotary_factor", 1.0))
            return (f"its rope ({rope.get('rope_type', rope.get('type'))}) has {len(value)} {key} entries (a rotary "
                    f"part of {factor} of its {head}-wide heads), and speculators builds a draft's rope over the "
                    f"whole head ({head // 2} entries a list, partial_rotary_factor dropped)")
    return None


def check_draft_arch(recipe_, text_cfg, model_path=""):
    """--draft-arch deepseek needs an MLA verifier whose rope transformers and vLLM compute alike (archs.DraftArch.misfit); the
    other drafts, a rope speculators can build (rope_misfit)."""
    arch = archs.of(recipe_)
    if arch.own_layer is None:
        why = rope_misfit(text_cfg)
        if why:
            raise UsageError(f"--model-path {model_path}: speculators cannot build this verifier's draft: {why}")
        return
    why = arch.misfit(text_cfg)
    if why:
        raise UsageError(f"--draft-arch {arch.name}: {why}; use --draft-arch llama")
    if recipe_.get("norm_before_fc") and not arch.norm_before_fc:
        raise UsageError("--norm-before-fc: the MLA draft (--draft-arch deepseek, auto's choice for an MLA verifier) "
                         "has no norm before the FC layer in vLLM; use --fc-norm (a norm per state) or "
                         "--no-norm-before-fc, or --draft-arch llama")


def check_draft_memory(num_layers, text_cfg, draft_vocab, on_gpu):
    """On a CPU, refuse a draft whose training state (float32 weights, gradients and two AdamW moments: 16 bytes a
    parameter, plus the verifier's frozen bf16 embedding) exceeds 90 % of the available RAM, before it is built."""
    if on_gpu:
        return
    h = text_cfg["hidden_size"]
    inter = text_cfg.get("intermediate_size") or 4 * h
    trainable = num_layers * (4 * h * h + 3 * h * inter) + 3 * h * h + draft_vocab * h
    need = trainable * 16 + text_cfg["vocab_size"] * h * 2
    have = available_ram() * 0.9
    if need > have:
        raise UsageError(f"--num-layers {num_layers}: training this draft takes about {need / 1e9:.1f} GB, more than "
                         f"the {have / 1e9:.1f} GB of RAM available here; use fewer layers")


TRAINING = [False]  # speculators' run_training is under way (its signal handler, or its interrupt save)


@contextlib.contextmanager
def acknowledged_signals(again_after=2.0):
    """A stop signal is answered at once with one line, even while the main thread is deep in a step (Python runs
    speculators' handler only when the step returns to the interpreter): the C-level wakeup fd hands each signal to
    a thread here. A second signal (more than `again_after` s later: torchrun and the loader workers resend the
    first) stops at once; the folder still resumes from its last complete checkpoint."""
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
                    last_words(2, f"error: stopped at once by a second {name}; the same command resumes from the "
                                  f"last complete checkpoint\n")
                    os._exit(128 + signum)
    threading.Thread(target=watch, daemon=True, name="signal-watch").start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old)
        os.close(w)
        for s, h in handlers.items():
            signal.signal(s, h)


def make_trainer_class(dense_log, on_cpu, max_steps, measure=None, ttt_steps=3, dtype="bfloat16", batch_step=None,
                       profile=None, verifier_norm=None):
    from speculators.train.trainer import Trainer
    pending = [True]  # the epoch a rerun resumes after may still need its validation (checkpoints.validate_pending)

    class PipelineTrainer(Trainer):
        def setup_model(self):
            if on_cpu:
                self.local_rank, self.device_type = "cpu", "cpu"
            super().setup_model()
            if verifier_norm is not None:  # the targets through the verifier's own final norm (target_check.py)
                adapters.own_verifier_norm(self.model, verifier_norm)
            # a batch of no token is named and counted (BatchGuard), never trained on silently
            step = batch_step(self.local_rank) if batch_step else None  # fp8: dequantized on the GPU
            self.train_loader = BatchGuard(self.train_loader, steps=(profile, step))  # --profile-steps: rank 0
            dense_log.clock = self.train_loader.clock  # tok/s and data wait on our clock, around the loader
            if self.val_loader is not None:
                self.val_loader = BatchGuard(self.val_loader, "validation", steps=(step,))
            steps = len(self.train_loader) * self.config.num_epochs
            dense_log.total = min(steps, max_steps) if max_steps else steps
            import torch
            dense_log.count_flops(self.model, ttt_steps, None if on_cpu else torch.cuda.get_device_name(), dtype,
                                  self.config.optimizer, dense_log.tokens_per_step, self.config.muon_ns_steps)

        def train_epoch(self, epoch, **kw):
            if pending[0]:  # this run's first epoch, inside speculators' loop: a stop here saves `interrupted`
                pending[0] = False
                checkpoints.validate_pending(self)
            if max_steps and self.global_step >= max_steps:
                return  # speculators would run one more step per remaining epoch
            return super().train_epoch(epoch, **kw)

        def run_training(self):
            # speculators 0.9 keeps looping over the remaining epochs after --max-steps, each one saving a
            # checkpoint and validating; stop at the epoch in which the last step falls
            if max_steps:
                need = -(-max_steps // max(1, len(self.train_loader)))
                self.config = self.config._replace(num_epochs=min(self.config.num_epochs, need))
            if self.current_epoch >= self.config.num_epochs:  # no epoch left: before speculators' handler, so that
                checkpoints.validate_pending(self)            # a stop ends the run now (a rerun validates again)
            TRAINING[0] = True
            return super().run_training()

        def val_epoch(self, epoch):
            if on_cpu:  # nothing is compiled on a CPU: speculators' own no_grad validation is the cheaper one
                return super().val_epoch(epoch)
            # through the training step's compiled graphs (warm_start.py says why)
            validating = warm_start.for_validation(self.model, self.is_distributed and self.config.fsdp_shard)
            if validating is None:
                return super().val_epoch(epoch)
            model, self.model = self.model, validating
            try:
                return super().val_epoch(epoch)
            finally:
                self.model = model

        def maybe_save_checkpoint(self, epoch, local_step=0):
            checkpoints.save(self, epoch, local_step, super().maybe_save_checkpoint)

        def maybe_update_best(self, epoch, val_metrics):
            checkpoints.update_best(self, epoch, val_metrics, measure, super().maybe_update_best)
    return PipelineTrainer


DRAFT_LAYER = "draft_layer_config.json"  # an MLA draft's decoder-layer config, in the output folder


def write_draft_layer(out, recipe_, text_cfg, num_layers):
    """Rank 0, before the data bridge the other ranks wait for: the MLA draft's layer config speculators builds it
    from (its own_layer's layer_config)."""
    arch = archs.of(recipe_)
    if arch.own_layer is not None:
        files.write_json(os.path.join(out, DRAFT_LAYER), arch.own_layer.layer_config(text_cfg, num_layers))


def train_config(args, bridge, aux_layer_ids, on_cpu, draft_vocab, storage="bf16", engine_url=None, dtype="bfloat16",
                 recipe_=None):
    """speculators' TrainConfig. `dtype` (compute.py) is its hidden_states_dtype: the loader's states and autocast.
    float32 turns autocast off (it knows only bf16/fp16) and the draft, whose master weights speculators keeps in
    float32 anyway, computes in float32; the checkpoint is saved bf16 either way."""
    from speculators.train.config import TrainConfig
    # GPU: up to 12 workers per rank (speculators' default) but no more than the cores each rank has: reading
    # per-sample files is most of a step's input cost. CPU: none, the training step already uses every core.
    per_rank = devices.cores() // devices.local_world_size()  # within a container's quota
    workers = args.num_workers if args.num_workers is not None else (0 if on_cpu else max(1, min(12, per_rank - 1)))
    if args.online and args.num_workers is None:  # a worker mostly waits for the engine: one runs ahead even on CPU
        workers = max(workers, 1) if on_cpu else min(workers, 4)
    flat = {
        "speculator_type": "eagle3", "verifier_name_or_path": args.model_path,
        "trust_remote_code": args.trust_remote_code, "num_layers": args.num_layers, "ttt_steps": args.ttt_steps,
        "target_layer_ids": aux_layer_ids,
        "d2t_path": os.path.join(args.vocab_mapping, "d2t.npy"), "t2d_path": os.path.join(args.vocab_mapping, "t2d.npy"),
        "draft_vocab_size": None, "data_path": bridge, "hidden_states_path": os.path.abspath(args.hidden_states),
        "hidden_states_backend": train_data.CHECKED,  # each sample checked where read (CheckedFiles); fp8 dequantized there
        "on_missing": "skip", "total_seq_len": args.total_seq_len, "train_data_ratio": 1 - args.val_ratio,
        "num_workers": workers, "prefetch_factor": 4, "epochs": args.epochs, "lr": args.lr,
        "max_steps": args.max_steps, "scheduler_warmup_steps": args.warmup_steps,
        "checkpoint_freq": args.checkpoint_freq, "log_freq": args.log_every, "save_path": os.path.abspath(args.output_dir),
        "log_dir": os.path.join(os.path.abspath(args.output_dir), "logs"), "seed": args.seed, "fsdp_shard": args.fsdp,
        "logger": "", "hidden_states_dtype": dtype,
    }
    if args.online:  # speculators' on-demand generation, through our transfer (online.py): cache first, then the engine
        flat.update(hidden_states_backend=BACKEND, hidden_states_path=os.path.join(os.path.abspath(args.output_dir),
                    CACHE), on_missing="generate", vllm_endpoint=engine_url, generation_validation_retries=1,
                    request_timeout=600.0, prefetch_factor=2)
    if on_cpu:  # no Triton driver, no flex attention: torch's sdpa
        flat.update(draft_attn_impl="sdpa")
    flat.update(recipe_ or DEFAULT_RECIPE)
    if archs.of(flat).own_layer is not None:  # speculators' public draft_config: the layer's own (write_draft_layer)
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


def run(cfg, args, on_cpu, dtype="bfloat16", loaders=None, measure=None, batch_step=None, verifier_norm=None):
    """speculators' own training entry point, with our Trainer subclass and dense log attached (adapters.py, for the
    run only); `dtype` the compute dtype (train_config's); `loaders`: a context that adapts speculators' data loaders
    for the run (online.loaders), or None; `measure`: validation_measure.Measure choosing checkpoint_best, or None
    (the trainer's estimate chooses it); `batch_step(device)`: what each batch goes through before the trainer
    (train_data.OfflineData.batch_step), or None; `verifier_norm`: the verifier's own final norm where speculators'
    would compute the targets otherwise (target_check.py), or None."""
    lifeline.start()  # data-loader and compile workers die with the stage too, however it ends
    warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator.*")
    # float32 compute: autocast says it does not know float32 and turns itself off, which is the point
    warnings.filterwarnings("ignore", message=".*autocast.*(not supported|only supports).*")
    logs = outdir.make_dir(os.path.join(os.path.abspath(args.output_dir), "logs"))
    if devices.rank() == 0:
        os.close(outdir.open_append(os.path.join(logs, "metrics.jsonl")))  # refused now, not after an epoch
    dense = DenseLog(every=1, total_steps=args.max_steps, jsonl=os.path.join(logs, "metrics.jsonl"),
                     tokens_per_step=args.total_seq_len)
    profile = None
    if args.profile_steps and devices.rank() == 0:
        profile = StepProfile(args.profile_steps, logs, not on_cpu)
    trainer_cls = make_trainer_class(dense, on_cpu, args.max_steps, measure, args.ttt_steps, dtype, batch_step,
                                     profile, verifier_norm)
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
            Recording, dense if devices.rank() == 0 else None, own_metric_lines=False))
        if on_cpu:
            stack.enter_context(adapters.cpu_without_accelerator())
        if loaders is not None:
            stack.enter_context(loaders)
        if cfg.data.num_workers and not args.online:  # started now, its imports run while the model loads
            server = warm_start.WorkerServer().start()
            stack.enter_context(adapters.loader_workers(server.context, warm_start.worker_init))
        for ctx in (adapters.muon_in_float32(dtype), adapters.recorded_artifacts(type(cfg)), archs.known(),
                    acknowledged_signals()):
            stack.enter_context(ctx)
        scli.main(cfg)
    t = holder.get("trainer")
    path = t.checkpointer.path if t else None
    real = lambda name: os.path.realpath(path / name) if path and (path / name).exists() else None  # noqa: E731
    return {"steps": t.global_step if t else 0, "steps_this_run": (t.global_step - holder.get("start_step", 0)) if t else 0,
            "checkpoint_last": real("last"),
            "checkpoint_best": real("checkpoint_best"), "best_val_loss": getattr(t, "best_val_loss", None),
            "best_expected_acceptance": max(checkpoints.best_acceptance(path), 0) or None if path else None,
            "best_acceptance_measure": (max(checkpoints.best_acceptance(path, measured=True), 0) or None) if path and measure
            else None,
            "data_wait_fraction": dense.wait_fraction}
