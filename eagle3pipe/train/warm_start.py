"""Stage 04's start and its validations at the pace of its steps.

Measured on a lent H200 at Kimi-K2.5's width (docs/BENCHMARKS.md), with the compile cache warm: the first step came
46-53 s after the epoch began, 23-39 s of it waiting for the first batch, and each validation of 4 batches took 32 s
while a training step takes 0.45 s. Two causes, one remedy each:

- **Data-loader workers start from a warm server** (`WorkerServer`). speculators' loaders spawn their workers: each
  is a fresh interpreter importing torch, transformers, datasets and speculators before it reads a file, a dozen at
  once contending for the cores, and the first batch waits for the first of them. Instead a fork server (the
  standard library's `forkserver` start method) is started as soon as training begins, imports those modules once
  while the draft and the verifier's weights load, and forks each worker from that warm state. What reaches a worker
  is unchanged (pickled as for spawn). The server asks for GPUs through NVML, which leaves its forked children free
  to use CUDA (they do not: their init only limits threads), and a probe worker forked from it must answer before the
  loaders use it; otherwise one warning line, and the workers are spawned as before. The workers
  are the server's children, not the stage's, and each holds the server's liveness pipe, so neither notices the
  stage's death by itself: the stage's lifeline (lifeline.py, started before the server) ends them with it, however
  it ends (tests/reliability/test_lifeline.py kills stage 04 mid-training).
- **Validation runs the training step's compiled graphs** (`ValidateAsTrained`). speculators validates under
  `torch.no_grad()` and `model.eval()`; on a GPU, where it compiles the draft's forward, grad mode is part of
  torch.compile's guards, so the first validation of every run compiled every graph of the draft again (12 of them,
  most of those 32 s, every run, cache or not). The draft is instead called as in training (grad on, train mode) and
  its outputs are detached at once, which frees the activations the forward saved. Train mode computes what eval
  mode computes only without dropout: every draft the pipeline trains has none, and a model with any active dropout
  is validated speculators' way. So is every draft on a CPU, where nothing is compiled and no_grad is cheaper.
"""
import contextlib
import logging
import multiprocessing
import os
import threading
from multiprocessing import forkserver
from ..adapters import interrupted
from ..base import faults
from ..base.inherited import child_pythonpath

log = logging.getLogger("eagle3")

# what a worker imports to unpickle its dataset, transfer and collate (speculators' and ours) and run its init
WORKER_MODULES = ("torch", "datasets", "speculators.train.data", "speculators.train.dataloader",
                  "eagle3pipe.train.train_data", "eagle3pipe.formats.fp8_transport", "eagle3pipe.train.warm_start")
PROBE_DEADLINE = 300  # seconds for the server's imports and one forked worker's answer


def server_env():
    """The server's environment beside the stage's: CUDA's availability asked through NVML (torch's `cudaGetDeviceCount`
    would initialise the driver in the server and leave every process forked from it unable to use CUDA: "poisoned");
    one thread per pool, as speculators sets for its spawned workers; this repository on the path (the standard
    library's server does not take the stage's sys.path)."""
    path = child_pythonpath(os.environ.get("PYTHONPATH"))
    return {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "PYTHONPATH": path}


@contextlib.contextmanager
def _environ(values):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def worker_init(worker_id):
    """A forked worker's start: one intra-op thread (speculators' own init also binds each worker to the rank's GPU,
    which a worker never uses and which a process forked after torch looked for GPUs may not do)."""
    import torch
    torch.set_num_threads(1)


def _probe(conn):
    """What a worker does first, in a process forked from the server: its init, and a tensor handed back through
    shared memory as a batch is (it stays until the tensor is received: its memory is passed by descriptor)."""
    faults.kill_point("worker-probe")
    import torch
    torch.manual_seed(0)  # as torch's worker loop seeds each worker (CUDA's generators too, where it may)
    worker_init(0)
    conn.send(torch.arange(8, dtype=torch.int64))
    conn.poll(60)


class WorkerServer:
    """The fork server the run's data-loader workers start from. `start()` launches it (its imports then run beside
    the main process's) and, in a thread, forks one probe worker from it; `context()` is what speculators' loaders
    get instead of "spawn" (adapters.loader_workers): the server's context once the probe has answered, else None
    and one warning line (the loaders then spawn their workers as speculators does)."""

    def __init__(self, modules=WORKER_MODULES, deadline=PROBE_DEADLINE):
        self.ctx = multiprocessing.get_context("forkserver")
        self.modules, self.deadline, self.why, self.thread = list(modules), deadline, None, None

    def start(self):
        self.ctx.set_forkserver_preload(self.modules)
        try:
            with _environ(server_env()):
                forkserver.ensure_running()  # returns at once: the server imports while the model loads
        except OSError as e:
            self.why = f"the fork server did not start ({e})"
            return self
        self.thread = threading.Thread(target=self._check, name="worker-server-probe", daemon=True)
        self.thread.start()
        return self

    def _check(self):
        ours, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(target=_probe, args=(theirs,), daemon=True)
        try:
            proc.start()
            theirs.close()
            got = ours.recv() if ours.poll(self.deadline) else None  # EOF (the worker died) raises EOFError
            if got is None:
                self.why = f"its probe worker did not answer within {self.deadline} s"
            elif int(got.sum()) != 28:
                self.why = "its probe worker's tensor came back wrong"
            ours.send("ok")
        except EOFError:
            proc.join(10)
            self.why = f"its probe worker died (exit code {proc.exitcode})"
        except Exception as e:  # noqa: BLE001 - any failure means: spawn the workers instead, and say why
            if interrupted(e):
                raise
            self.why = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
            ours.close()

    def context(self):
        """The context to start workers from, or None (spawn them), waiting for the probe up to its deadline."""
        if self.thread is not None:
            self.thread.join(self.deadline + 10)
            if self.thread.is_alive():
                self.why = self.why or f"its probe did not finish within {self.deadline} s"
        if self.why:
            log.warning(f"data-loader workers: the fork server is not used ({self.why}); they are spawned, as "
                        f"speculators does, and the first batch waits for their imports")
            self.thread, self.why, self.ctx = None, None, None
        return self.ctx


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
