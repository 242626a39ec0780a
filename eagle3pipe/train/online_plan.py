"""Stage 04 --online, its preflight (seconds, no torch, no vLLM): where the extraction engine runs (an address, or
GPUs/CPU and a port), how much memory it may take, and the layer ids it stores. -> `OnlinePlan`."""
import dataclasses
import importlib.util
import os
import socket
from typing import Optional

from ..base import compute, devices
from ..base.devices import available_ram, visible_gpus
from ..base.errors import UsageError
from ..engines import engines
from ..engines.engine import get_json
from ..storage import outdir
from ..verifier import quantization
from ..verifier.verifier import weights_bytes


def check_address(flag, address, model_path):
    """A running engine at host:port that serves `model_path` (speculators insists on the same model id)."""
    url = f"http://{address}/v1/models"
    try:
        ids = [m.get("id") for m in get_json(url, 3).get("data", [])]
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise UsageError(f"{flag} {address}: no engine answers at {url} ({getattr(e, 'reason', e)}); start it first "
                         f"or drop the flag to let stage 04 start one")
    if model_path not in ids:
        raise UsageError(f"{flag} {address}: the engine there serves {ids}, not --model-path {model_path}; give the "
                         f"same path or id the engine was started with")


def free_port(flag, port):
    """`port` if it is free (else one line), or any free port when `port` is None."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port or 0))
        except OSError as e:
            raise UsageError(f"{flag} {port}: in use ({e.strerror}); pick another or drop the flag")
        return s.getsockname()[1]


def split_gpus(engine_gpus, n_visible):
    """(engine GPUs, trainer GPUs), as indices among the GPUs this process sees. Default: none on CPU; one GPU is
    shared; otherwise the engine takes the first half and training the rest."""
    if n_visible == 0:
        if engine_gpus:
            raise UsageError(f"--engine-gpus {','.join(map(str, engine_gpus))}: no GPU visible here")
        return [], []
    if engine_gpus is None:
        engine_gpus = [0] if n_visible == 1 else list(range(n_visible // 2))
    bad = [g for g in engine_gpus if g >= n_visible]
    if bad or len(set(engine_gpus)) != len(engine_gpus):
        raise UsageError(f"--engine-gpus {','.join(map(str, engine_gpus))}: {n_visible} GPU(s) visible (0-"
                         f"{n_visible - 1}); give distinct indices among them")
    rest = [g for g in range(n_visible) if g not in engine_gpus]
    return engine_gpus, rest or list(engine_gpus)  # no GPU left: training shares the engine's


def check_engine(s, text_cfg, weights, gpus, engine_gpus, shared):
    """What can be known before the engine loads: vLLM installed, TP against the heads, the weights in the memory
    the engine may use. -> the memory fraction vLLM may take on each of its GPUs."""
    kind = engines.kind(s.backend)
    if importlib.util.find_spec(kind.module) is None:
        raise UsageError(f"--backend {kind.name}: {kind.module} is not installed here; use another --backend, or "
                         f"--engine-address of an engine running elsewhere")
    tp = max(1, len(engine_gpus))
    memory = s.engine_memory if s.engine_memory is not None else (0.45 if shared else 0.85)
    if weights:
        if engine_gpus:
            # vLLM splits the weights evenly over TP; the HF engine fills its GPUs one after another
            have = memory * (min(gpus[i][1] for i in engine_gpus) * tp if kind.weights_split_evenly
                             else sum(gpus[i][1] for i in engine_gpus))
            where = f"{tp} engine GPU(s) at --engine-memory {memory}"
        else:
            have, where = available_ram() * 0.8, "80% of the available RAM"
        if weights > have:
            raise UsageError(f"--model-path {s.model_path}: {weights / 1e9:.1f} GB of weights do not fit in {where} "
                             f"({have / 1e9:.1f} GB); give the engine more GPUs (--engine-gpus) or memory "
                             f"(--engine-memory)")
    return memory


@dataclasses.dataclass(frozen=True)
class OnlinePlan:
    """What the online preflight decided."""
    layer_ids: list              # the auxiliary ids, then n
    hidden_size: int
    address: Optional[str]       # an engine already running, or None: stage 04 starts one
    port: Optional[int]
    engine_cvd: Optional[str]    # CUDA_VISIBLE_DEVICES for the engine (None: CPU)
    trainer_cvd: Optional[str]   # ... for stage 04 itself, when it must not see the engine's GPUs
    tp: int
    memory: float                # vLLM's gpu_memory_utilization
    max_len: int                 # the engine's max model length: the longest row plus the one generated token
    cache_bytes: int
    dtype: Optional[str] = None  # what the engine computes in (compute.py); None: an engine already running
    spool: Optional[str] = None  # an engine already running: the folder it writes to (--engine-spool)

    @property
    def n_states(self):
        return len(self.layer_ids)

    @property
    def on_gpu(self):
        return self.engine_cvd is not None


def plan(s, fp, text_cfg, longest, layer_ids):
    """Every online check that needs no model: the engine's address or port, GPUs, TP, memory. `s`: settings.Train;
    `layer_ids`: the resolved ids the engine stores (the auxiliary ones, then n)."""
    common = dict(layer_ids=layer_ids, hidden_size=fp["hidden_size"], max_len=longest + 1,
                  cache_bytes=int(s.cache_gb * 1e9))
    if s.engine_address:
        check_address("--engine-address", s.engine_address, s.model_path)
        if not os.path.isdir(s.engine_spool):
            raise UsageError(f"--engine-spool {s.engine_spool}: not a folder; give the folder the engine at "
                             f"--engine-address writes to")
        # the files the engine hands back are deleted once read: never in a stage's folder or this run's inputs
        outdir.check_path("--engine-spool", s.engine_spool, [
            ("--prepared-data", s.prepared_data), ("--vocab-mapping", s.vocab_mapping), ("--model-path", s.model_path)])
        spool, out = os.path.realpath(s.engine_spool), os.path.realpath(s.output_dir)  # the output may not exist yet
        if spool == out or spool.startswith(out + os.sep) or out.startswith(spool.rstrip(os.sep) + os.sep):
            raise UsageError(f"--engine-spool {s.engine_spool}: is, holds or sits inside --output-dir "
                             f"{s.output_dir}; give the engine a folder of its own")
        for record in (outdir.LEDGER, outdir.OLD_RECORD):
            if os.path.lexists(os.path.join(s.engine_spool, record)):
                raise UsageError(f"--engine-spool {s.engine_spool}: holds a pipeline stage's output ({record}); give "
                                 f"the engine a folder of its own")
        return OnlinePlan(address=s.engine_address, port=None, engine_cvd=None, trainer_cvd=None, tp=1, memory=0.0,
                    spool=os.path.abspath(s.engine_spool), **common)
    gpus = visible_gpus()
    engine_gpus, trainer_gpus = split_gpus(s.engine_gpus, len(gpus))
    shared = bool(engine_gpus) and set(engine_gpus) == set(trainer_gpus)
    dtype = compute.resolve(s.dtype, bool(gpus))
    tp = max(1, len(engine_gpus))
    kind = engines.kind(s.backend)
    quant = quantization.read(s.model_path)
    engines.check_engine(kind, tp, f"--engine-gpus: {tp} GPUs as tensor parallel", text_cfg, gpus, dtype.dtype,
                         "the trainer reads bf16", quant, fp.get("architecture"))
    stored = quant.dequantized_bytes if quant and not kind.keeps_quantized else weights_bytes(s.model_path)
    memory = check_engine(s, text_cfg, compute.loaded_weights_bytes(stored, fp.get("torch_dtype"), dtype.dtype), gpus,
                          engine_gpus, shared)
    port = free_port("--engine-port", s.engine_port)
    return OnlinePlan(address=None, port=port, engine_cvd=devices.physical(engine_gpus) if gpus else None,
                trainer_cvd=devices.physical(trainer_gpus) if gpus and not shared else None,
                tp=max(1, len(engine_gpus)) if engines.kind(s.backend).tensor_parallel else 1, memory=memory, dtype=dtype.dtype, **common)


def describe(p, backend):
    if p.address:
        return f"extraction engine at {p.address}"
    where = f"GPU(s) {p.engine_cvd}" if p.on_gpu else "CPU"
    train = f"; training on GPU(s) {p.trainer_cvd}" if p.trainer_cvd else (" (shared with training)" if p.on_gpu else "")
    return (f"extraction engine: {backend} on {where}{train}, TP {p.tp}, {p.dtype}, port {p.port}, layer ids "
            f"{p.layer_ids}")
