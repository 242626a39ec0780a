"""Stage 04's start and its validations at the pace of its steps.

Measured on a lent H200 at Kimi-K2.5's width (docs/BENCHMARKS.md), with the compile cache warm: the first step came
46-53 s after the epoch began, 23-39 s of it waiting for the first batch, and each validation of 4 batches took 32 s
while a training step takes 0.45 s. Two causes, one remedy each:

- **Data-loader workers start from a warm server** (`WorkerServer`). speculators' loaders spawn their workers: each
  is a fresh interpreter importing torch, transformers, datasets and speculators before it reads a file, a dozen at
  once contending for the cores, and the first batch waits for the first of them. Instead a fork server (the
  standard library's `forkserver` start method) is started as soon as training begins, imports those modules once
  while the draft and the verifier's weights load, and forks each worker from that warm state. What reaches a worker
  is unchanged (pickled as for spawn); the server never touches a GPU (it forks before anything could). The workers
  are the server's children, not the stage's, and each holds the server's liveness pipe, so neither notices the
  stage's death by itself: the stage's lifeline (lifeline.py, started before the server) ends them with it, however
  it ends (tests/reliability/test_lifeline.py kills stage 04 mid-training).
- **Validation runs the training step's compiled graphs** (`ValidateAsTrained`). speculators validates under
  `torch.no_grad()` and `model.eval()`; on a GPU, where it compiles the draft's forward, grad mode is part of
  torch.compile's guards, so the first validation of every run compiled every graph of the draft again (12 of them,
  most of those 32 s, every run, cache or not). The draft is instead called as in training (grad on, train mode) and
  its outputs are detached at once, which frees the activations the forward saved. Train mode computes what eval
  mode computes only without dropout: every draft the pipeline trains has none, and a model with any active dropout
  is validated speculators' way.
"""
import logging
import multiprocessing

log = logging.getLogger("eagle3")

# what a worker imports to unpickle its dataset, transfer and collate (speculators' and ours) and run its init
WORKER_MODULES = ("torch", "datasets", "speculators.train.data", "speculators.train.dataloader",
                  "eagle3pipe.train_data", "eagle3pipe.fp8_transport")


class WorkerServer:
    """The fork server the run's data-loader workers start from. `start()` launches it (its imports then run beside
    the main process's); `context` is what speculators' loaders get instead of "spawn" (adapters.loader_workers)."""

    def __init__(self, modules=WORKER_MODULES):
        self.context = multiprocessing.get_context("forkserver")
        self.modules = list(modules)

    def start(self):
        from multiprocessing import forkserver
        self.context.set_forkserver_preload(self.modules)
        forkserver.ensure_running()  # returns at once: the server imports while the model loads
        return self


def dropout_free(model):
    """True when no module of `model` drops anything in train mode (nn.Dropout p, attention_dropout)."""
    for m in model.modules():
        if getattr(m, "p", 0) and "Dropout" in type(m).__name__:
            return False
        if getattr(m, "attention_dropout", 0) or getattr(getattr(m, "config", None), "attention_dropout", 0):
            return False
    return True


def _detached(x):
    if hasattr(x, "detach"):
        return x.detach()
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(v) for v in x)
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


class ValidateAsTrained:
    """The draft as speculators' validation loop calls it (`self.model(**batch)`, `self.model.eval()`), computing as a
    training step does: grad on, train mode kept, outputs detached. Anything else is the model's own."""

    def __init__(self, model):
        self.model = model

    def eval(self):
        return self  # train mode: the guards torch.compile compiled the step under (no dropout: dropout_free)

    def __call__(self, *args, **kwargs):
        import torch
        with torch.enable_grad():
            out = self.model(*args, **kwargs)
        return _detached(out)

    def __getattr__(self, name):
        return getattr(self.model, name)


def for_validation(model, sharded=False):
    """What validation should call: `ValidateAsTrained` around the draft (the module itself under DDP: no gradient
    sync is wanted), or None to validate speculators' way (`sharded`: FSDP spreads the draft over the ranks, and a
    forward under grad without its backward would leave its hooks waiting; a draft with dropout)."""
    inner = getattr(model, "module", model)
    if sharded or not dropout_free(inner):
        return None
    return ValidateAsTrained(inner)
