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
"""
import dataclasses
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Optional

from . import compute, outdir
from .errors import RunError, UsageError

log = logging.getLogger("eagle3")

SPOOL = ".online"                 # the engine's files, each deleted (or moved into the cache) once read
CACHE = "hidden_states_cache"     # --cache-gb: kept samples, stage 02's format (hs_{i}.safetensors)
ENGINE_LOG = "engine.log"
SKIPPED = "skipped.jsonl"         # in logs/: one line per sample skipped (non-finite states, engine errors)
BACKEND = "eagle3pipe-online"     # the name our transfer is registered under in speculators' backend registry


# ---------------------------------------------------------------- preflight (seconds, no torch, no vLLM)

def _get_json(url, timeout):
    """The JSON an HTTP endpoint answers; ValueError for anything that is not an HTTP answer with a JSON body (a port
    that speaks another protocol), OSError when nothing answers within `timeout`."""
    import http.client
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read(1 << 20))
    except http.client.HTTPException as e:
        raise ValueError(f"not an HTTP answer: {type(e).__name__}")


def check_address(flag, address, model_path):
    """A running engine at host:port that serves `model_path` (speculators insists on the same model id)."""
    url = f"http://{address}/v1/models"
    try:
        ids = [m.get("id") for m in _get_json(url, 3).get("data", [])]
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


def physical(indices):
    """CUDA_VISIBLE_DEVICES entries for indices among this process's visible GPUs."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in cvd.split(",")] if cvd else None
    return ",".join(ids[i] if ids else str(i) for i in indices)


def check_engine(s, text_cfg, weights, gpus, engine_gpus, shared):
    """What can be known before the engine loads: vLLM installed, TP against the heads, the weights in the memory
    the engine may use. -> the memory fraction vLLM may take on each of its GPUs."""
    import importlib.util
    if s.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UsageError("--backend vllm: vLLM is not installed here; use --backend hf (transformers), or "
                         "--engine-address of an engine running elsewhere")
    tp = max(1, len(engine_gpus))
    if s.backend == "vllm":
        for what in ("num_attention_heads", "num_key_value_heads"):
            h = text_cfg.get(what)
            if h and h % tp and not (what == "num_key_value_heads" and tp % h == 0):
                raise UsageError(f"--engine-gpus: {tp} GPUs as tensor parallel must divide the verifier's {what} ({h})")
    memory = s.engine_memory if s.engine_memory is not None else (0.45 if shared else 0.85)
    if weights:
        if engine_gpus:
            # vLLM splits the weights evenly over TP; the HF engine fills its GPUs one after another
            have = memory * (min(gpus[i][1] for i in engine_gpus) * tp if s.backend == "vllm"
                             else sum(gpus[i][1] for i in engine_gpus))
            where = f"{tp} engine GPU(s) at --engine-memory {memory}"
        else:
            from .preflight import available_ram
            have, where = available_ram() * 0.8, "80% of the available RAM"
        if weights > have:
            raise UsageError(f"--model-path {s.model_path}: {weights / 1e9:.1f} GB of weights do not fit in {where} "
                             f"({have / 1e9:.1f} GB); give the engine more GPUs (--engine-gpus) or memory "
                             f"(--engine-memory)")
    return memory


@dataclasses.dataclass(frozen=True)
class Plan:
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


def plan(s, fp, text_cfg, longest):
    """Every online check that needs no model: layer ids, the engine's address or port, GPUs, TP, memory."""
    from .engine import visible_gpus
    from .preflight import weights_bytes
    from .verifier import resolve_layer_ids
    layer_ids = resolve_layer_ids(s.layer_ids, fp["num_hidden_layers"])
    common = dict(layer_ids=layer_ids, hidden_size=fp["hidden_size"], max_len=longest + 1,
                  cache_bytes=int(s.cache_gb * 1e9))
    if s.engine_address:
        check_address("--engine-address", s.engine_address, s.model_path)
        if not os.path.isdir(s.engine_spool):
            raise UsageError(f"--engine-spool {s.engine_spool}: not a folder; give the folder the engine at "
                             f"--engine-address writes to")
        return Plan(address=s.engine_address, port=None, engine_cvd=None, trainer_cvd=None, tp=1, memory=0.0,
                    spool=os.path.abspath(s.engine_spool), **common)
    gpus = visible_gpus()
    engine_gpus, trainer_gpus = split_gpus(s.engine_gpus, len(gpus))
    shared = bool(engine_gpus) and set(engine_gpus) == set(trainer_gpus)
    dtype = compute.resolve(s.dtype, bool(gpus))
    if s.backend == "vllm" and not gpus:  # our connector adapts vLLM's (adapters.py): the installed one must fit
        from .adapters import check_private
        check_private("vllm")
    if s.backend == "vllm" and gpus and dtype.dtype == "float32":
        raise UsageError("--dtype float32: vLLM's hidden-states connector on GPU stores states in the compute dtype, "
                         "and the trainer reads bf16; use --dtype auto (bf16 on GPUs) or --backend hf")
    memory = check_engine(s, text_cfg, compute.loaded_weights_bytes(weights_bytes(s.model_path), fp.get("torch_dtype"),
                          dtype.dtype), gpus, engine_gpus, shared)
    port = free_port("--engine-port", s.engine_port)
    return Plan(address=None, port=port, engine_cvd=physical(engine_gpus) if gpus else None,
                trainer_cvd=physical(trainer_gpus) if gpus and not shared else None,
                tp=max(1, len(engine_gpus)) if s.backend == "vllm" else 1, memory=memory, dtype=dtype.dtype, **common)


def describe(p, backend):
    if p.address:
        return f"extraction engine at {p.address}"
    where = f"GPU(s) {p.engine_cvd}" if p.on_gpu else "CPU"
    train = f"; training on GPU(s) {p.trainer_cvd}" if p.trainer_cvd else (" (shared with training)" if p.on_gpu else "")
    return (f"extraction engine: {backend} on {where}{train}, TP {p.tp}, {p.dtype}, port {p.port}, layer ids "
            f"{p.layer_ids}")


# ---------------------------------------------------------------- the engine process

def launch(s, p, out, probe_ids):
    """Start the engine stage 04 owns (or point at --engine-address), wait until it answers, and check its first
    answer (`probe_ids`: a few tokens of the first row)."""
    engine = Engine(f"http://{p.address}/v1") if p.address else _start(s, p, out)
    try:
        engine.probe(s.model_path, probe_ids, p.n_states, p.hidden_size, spool_of(out, p))
    except RunError:
        engine.stop()
        raise
    return engine


def _start(s, p, out):
    from .engine import cpu_vllm_env
    spool = os.path.join(out, SPOOL)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")  # our connector and hf_server import from here
    if p.on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = p.engine_cvd
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        cpu_vllm_env(env)
    cmd = engine_command(s, p.layer_ids, spool, p.port, p.max_len, p.tp, p.memory, p.on_gpu, p.dtype)
    engine = Engine.start(cmd, env, os.path.join(out, ENGINE_LOG), p.port)
    took = engine.wait_ready(s.engine_timeout)
    log.info(f"extraction engine ({s.backend}, pid {engine.proc.pid}) ready in {took:.0f} s at {engine.url}; its "
             f"log: {engine.log_path}")
    return engine

def engine_command(s, layer_ids, spool, port, max_len, tp, memory, on_gpu, dtype):
    if s.backend == "hf":
        cmd = [sys.executable, "-m", "eagle3pipe.hf_server", "--model-path", s.model_path, "--layer-ids",
               ",".join(map(str, layer_ids)), "--spool", spool, "--port", str(port), "--dtype", dtype]
        return cmd + (["--trust-remote-code"] if s.trust_remote_code else [])
    from .engine import connector_config, server_module
    cmd = [sys.executable, "-m", server_module(), "--model", s.model_path, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_len), "--no-enable-prefix-caching",
           "--tensor-parallel-size", str(tp), "--gpu-memory-utilization", str(memory),
           "--speculative-config", json.dumps({"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                               "draft_model_config": {"hf_config": {
                                                   "eagle_aux_hidden_state_layer_ids": layer_ids}}}),
           "--kv-transfer-config", json.dumps(connector_config(spool, on_gpu))]
    if not on_gpu:
        cmd.append("--enforce-eager")
    return cmd + (["--trust-remote-code"] if s.trust_remote_code else [])


def _parent_death_signal(sig):
    """Linux: this process gets `sig` when its parent dies, even by SIGKILL."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _die_with_parent():
    """In the engine's process, before exec: SIGTERM when stage 04 dies, so no engine outlives it (holding its GPUs
    and port); its own process group, stopped as a whole and untouched by the terminal's Ctrl-C."""
    _parent_death_signal(signal.SIGTERM)
    os.setsid()


def worker_init(worker_id):
    """speculators' data-loader worker setup, plus: die with stage 04. A worker blocked in a request to the engine
    would otherwise outlive a killed run for the request's timeout, holding its connection open, and the engine
    (which on SIGTERM waits for its connections to close) with it."""
    import speculators.train.dataloader as sdl
    _parent_death_signal(signal.SIGKILL)
    if os.getppid() == 1:  # the parent was gone before the line above
        os._exit(1)
    from .adapters import original
    original(sdl, "_worker_init_fn")(worker_id)  # a forked worker inherits the patch; a spawned one has the original


class Engine:
    """The extraction engine stage 04 runs (or one at --engine-address): start, wait until it answers, watch it."""

    def __init__(self, url, proc=None, log_path=None):
        self.url, self.proc, self.log_path, self.stopping = url, proc, log_path, False

    @classmethod
    def start(cls, cmd, env, log_path, port):
        from .engine import open_log
        f = os.fdopen(open_log(log_path), "ab")  # never through a link planted at that name
        f.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        f.close()
        return cls(f"http://127.0.0.1:{port}/v1", proc, log_path)

    def last_line(self):
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 4096))
                lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
            return lines[-1].strip()[:300] if lines else ""
        except (OSError, TypeError):
            return ""

    def wait_ready(self, timeout):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RunError(f"the extraction engine exited with code {self.proc.returncode} while loading; its log "
                               f"{self.log_path} ends: {self.last_line()}")
            try:
                _get_json(self.url + "/models", 2)
                return time.time() - t0
            except (OSError, ValueError):
                time.sleep(1)
        raise RunError(f"the extraction engine did not answer at {self.url} within --engine-timeout {timeout} s; see "
                       f"{self.log_path}")

    def probe(self, model, token_ids, n_states, hidden, spool):
        """One short request before training: the engine answers with a file this process can read, holding
        [T, n_states, hidden] states for exactly these tokens. An engine storing other layers (another --layer-ids,
        another model) or writing where this machine cannot read is refused here, not after the first batch."""
        from .extraction import wait_for_engine_file
        from .hidden_states import read_header
        body = json.dumps({"model": model, "prompt": token_ids, "max_tokens": 1, "return_token_ids": True}).encode()
        req = urllib.request.Request(self.url + "/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                path = (json.loads(r.read()).get("kv_transfer_params") or {}).get("hidden_states_path")
        except (OSError, ValueError) as e:
            raise RunError(f"the extraction engine at {self.url} failed a first request ({e}); see its log "
                           f"{self.log_path or 'on its host'}")
        if not path:
            raise RunError(f"the extraction engine at {self.url} returned no hidden_states_path: it runs without the "
                           f"hidden-states connector")
        if not outdir.confined(spool, path):
            raise RunError(f"the extraction engine at {self.url} wrote {outdir.quote(path)}, outside the spool "
                           f"{spool}; nothing there is read or deleted: start it with --spool {spool}")
        try:
            wait_for_engine_file(path, spool)
            shape = read_header(path)[0]["hidden_states"]["shape"]
            outdir.remove_spool_file(spool, path)
        except (OSError, ValueError, KeyError) as e:
            raise RunError(f"the extraction engine wrote {path}, which this process cannot read or delete ({e}); "
                           f"its spool must be on a filesystem stage 04 shares")
        if shape != [len(token_ids), n_states, hidden]:
            raise RunError(f"the extraction engine at {self.url} stores hidden states of shape {shape} for "
                           f"{len(token_ids)} tokens; this run needs [{len(token_ids)}, {n_states}, {hidden}] (its "
                           f"layer ids or model differ from --layer-ids / --model-path)")

    def watch(self, on_death, every=5.0):
        """A daemon thread: when the engine dies (our child exits; an outside one fails 3 probes in a row),
        `on_death(reason)` is called once."""
        def loop():
            misses = 0
            while not self.stopping:
                time.sleep(every)
                if self.stopping:
                    return
                if self.proc is not None:
                    if self.proc.poll() is not None:
                        return on_death(f"exited with code {self.proc.returncode}; its log {self.log_path} ends: "
                                        f"{self.last_line()}")
                    continue
                try:
                    _get_json(self.url + "/models", 5)
                    misses = 0
                except (OSError, ValueError) as e:
                    misses += 1
                    if misses >= 3:
                        return on_death(f"at {self.url} stopped answering ({getattr(e, 'reason', e)})")
        threading.Thread(target=loop, daemon=True, name="engine-watch").start()

    def stop(self):
        self.stopping = True
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------- the cache and speculators' dataset

class CacheTransfer:
    """speculators' HiddenStatesTransfer for --online: hands the dataset the samples `OnlineArrowDataset` fetched,
    and keeps generated files in `cache_dir` while the budget allows. Picklable (data-loader workers are spawned)."""

    def __init__(self, cache_dir, budget_bytes, skipped_log, concurrency, n_states, hidden, nan_rows=(), spool=None):
        self.cache_dir, self.budget, self.skipped_log, self.spool = cache_dir, budget_bytes, skipped_log, spool
        self.n_states, self.hidden = n_states, hidden
        self.concurrency, self.nan_rows = concurrency, set(nan_rows)
        self.ready, self.local = {}, None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("ready", "local")}

    def __setstate__(self, state):
        self.__dict__.update(state, ready={}, local=None)
        outdir.attach(os.path.dirname(self.cache_dir))  # a spawned worker records what it caches in stage 04's record

    def _index(self):
        return getattr(self.local, "index", None) if self.local else None

    def setup(self):
        pass

    def get_cached(self, file_idx):
        return self.ready.pop(int(file_idx), None)

    def from_cache(self, file_idx, token_ids):
        """A cached sample {hidden_states, token_ids} after the full check (CRC, token ids, finite), or None; a bad
        file is deleted (it will be generated again)."""
        from .hidden_states import hs_path, load_checked
        if not self.budget:
            return None
        path = hs_path(self.cache_dir, file_idx)
        if not os.path.exists(path):
            return None
        reason, tensors = load_checked(path, token_ids, self.n_states, self.hidden)
        if reason:
            log.warning(f"{path}: {reason}; generating it again")
            self._release(path)
            return None
        return {"hidden_states": tensors["hidden_states"], "token_ids": tensors["token_ids"]}

    def get_generated(self, params):
        from .extraction import wait_for_engine_file
        from safetensors.torch import load_file
        path = params.get("hidden_states_path") or params.get("handle")
        if not wait_for_engine_file(path, self.spool):
            raise RunError(f"the engine named {outdir.quote(path)}, outside the spool {self.spool}; nothing there is "
                           f"read or deleted")
        tensors = load_file(path)
        if self._index() in self.nan_rows:  # fault injection: poison what speculators' check then sees
            tensors["hidden_states"] = tensors["hidden_states"].clone()
            tensors["hidden_states"].view(-1)[0] = float("nan")
        return tensors

    def delete(self, handle):
        """After speculators has checked the sample: keep it in the cache if it fits, else delete it."""
        i = self._index()
        if not outdir.confined(self.spool, handle):
            return  # not the engine's file in our spool: never deleted
        if i is None or not self.budget or not self._keep(handle, i):
            outdir.remove_spool_file(self.spool, handle)

    def _keep(self, path, i):
        from .hidden_states import hs_path, read_header, save
        dest, size = hs_path(self.cache_dir, i), os.path.getsize(path)
        with _BudgetLock(self.cache_dir) as b:
            if b.used + size > self.budget or os.path.exists(dest):
                return False
            b.used += size
        if "crc32" in (read_header(path)[0].get("__metadata__") or {}):
            outdir.install(path, dest)  # our CPU connector's or hf_server's file: already stage 02's format
        else:  # vLLM's GPU connector writes no checksum: rewrite it with one
            from safetensors.torch import load_file
            save(dest, load_file(path))
            outdir.remove_spool_file(self.spool, path)
        return True

    def _release(self, path):
        with _BudgetLock(self.cache_dir) as b:
            try:
                size = os.path.getsize(path)
                if not outdir.remove(path):
                    b.used = max(0, b.used - size)
            except FileNotFoundError:
                pass

    def skipped(self, file_idx, reason):
        line = json.dumps({"row": int(file_idx), "reason": reason[:300], "time": time.time()}) + "\n"
        fd = outdir.open_append(self.skipped_log)
        try:
            os.write(fd, line.encode())  # one write with O_APPEND: lines of concurrent workers never interleave
        finally:
            os.close(fd)


class _BudgetLock:
    """The cache's used bytes in `.used`, changed under an flock shared by every worker process."""

    def __init__(self, folder):
        self.path = os.path.join(folder, ".used")

    def __enter__(self):
        self.fd = outdir.open_append(self.path + ".lock", os.O_RDWR)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd) as f:
                self.used = self.before = int(f.read(32).strip() or 0)
        except (OSError, ValueError):
            self.used = self.before = 0
        return self

    def __exit__(self, *exc):
        try:
            if self.used != self.before:
                from .files import atomic_path
                with atomic_path(self.path) as tmp, open(tmp, "w") as f:
                    f.write(str(self.used))
        finally:
            os.close(self.fd)


def prepare_cache(cache_dir, budget_bytes):
    """Rank 0, before training: the cache's files re-counted (a killed run may have left the count behind) and files
    over a smaller budget than last time dropped; only files the record says this stage made count, or are deleted
    (a killed writer's temporary files went when the folder was claimed). -> (files, bytes)."""
    from .hidden_states import HS_NAME
    outdir.make_dir(cache_dir)
    names, used = [], 0
    for e in sorted(os.scandir(cache_dir), key=lambda e: e.name):
        if e.name[3:-12].isdigit() and e.name == HS_NAME.format(int(e.name[3:-12])) and outdir.owned(e.path):
            names.append((int(e.name[3:-12]), e))
    kept = 0
    for i, e in sorted(names):
        size = e.stat().st_size
        if used + size > budget_bytes:
            outdir.remove(e.path)
        else:
            used, kept = used + size, kept + 1
    with _BudgetLock(cache_dir) as b:
        b.used = used
        b.before = -1  # always write the count
    return kept, used


def dataset_class():
    """speculators' ArrowDataset with a packed batch's samples fetched together (cache first, then all missing ones
    concurrently from the engine). Defined on first use: speculators imports torch."""
    global OnlineArrowDataset
    if "OnlineArrowDataset" in globals():
        return OnlineArrowDataset
    from concurrent.futures import ThreadPoolExecutor

    from speculators.train.data import ArrowDataset, build_client_item
    from speculators.train.recovery import SampleUnavailable

    class OnlineArrowDataset(ArrowDataset):
        def __getitems__(self, indices):
            t = self.transfer
            if t.local is None:
                t.local = threading.local()
            missing = []
            for index in indices:
                fi = int(self._map_to_file_idx(index))  # the sampler's indices are numpy integers
                got = t.from_cache(fi, self.data[index]["input_ids"].tolist())
                if got is None:
                    missing.append(index)
                else:
                    t.ready[fi] = got
            if missing:
                if self.client is None:
                    try:
                        self._setup_client()
                    except Exception:  # noqa: BLE001 - each sample's own attempts below report it
                        pass
                with ThreadPoolExecutor(min(len(missing), t.concurrency)) as ex:
                    for index, res in zip(missing, ex.map(self._generate, missing)):
                        t.ready[int(self._map_to_file_idx(index))] = res
            return [self[i] for i in indices]

        def _generate(self, index):
            t, fi = self.transfer, int(self._map_to_file_idx(index))
            t.local.index = fi
            item = self.data[index]
            res = self.generation_recovery.run(
                lambda: self._generate_hidden_states_once(item, build_client_item(item)),
                description=f"row {fi}: hidden-state generation failed")
            if isinstance(res, SampleUnavailable):
                t.skipped(fi, res.reason)
            return res

    OnlineArrowDataset.__module__ = __name__
    OnlineArrowDataset.__qualname__ = "OnlineArrowDataset"
    return OnlineArrowDataset


def __getattr__(name):  # a spawned data-loader worker unpickling the dataset finds the class here
    if name == "OnlineArrowDataset":
        return dataset_class()
    raise AttributeError(name)


def install(out, p, url):
    """Register our transfer with speculators (its public registry). -> the transfer."""
    from hs_connectors.transfer import HiddenStatesTransfer
    from .adapters import register_backend
    from .faults import nan_rows
    cache_dir, logs = os.path.join(out, CACHE), os.path.join(out, "logs")
    transfer = CacheTransfer(cache_dir, p.cache_bytes, os.path.join(logs, SKIPPED), 64, p.n_states, p.hidden_size,
                             nan_rows(), spool=spool_of(out, p))
    HiddenStatesTransfer.register(CacheTransfer)  # an ABC: ours is a virtual subclass
    _transfer[0] = transfer
    register_backend(BACKEND, lambda: _transfer[0])
    return transfer


_transfer = [None]


def loaders():
    """For training.run: speculators' loaders build OnlineArrowDataset and start workers with worker_init."""
    from .adapters import online_dataset
    return online_dataset(dataset_class(), worker_init)


def summary(out, p):
    """For stage 04's manifest: the mode, the cache's state and the samples skipped."""
    skipped = set()
    try:
        with open(os.path.join(out, "logs", SKIPPED)) as f:
            skipped = {json.loads(line)["row"] for line in f if line.strip()}
    except (OSError, ValueError, KeyError):
        pass
    cache = os.path.join(out, CACHE)
    names = [n for n in os.listdir(cache) if n.startswith("hs_")] if os.path.isdir(cache) else []
    return {"mode": "cached" if p.cache_bytes else "online", "engine": p.address or "started by stage 04",
            "cache_budget_bytes": p.cache_bytes, "cache_files": len(names),
            "cache_bytes": sum(os.path.getsize(os.path.join(cache, n)) for n in names),
            "skipped_samples": len(skipped)}


def stop_run(reason, out):
    """The engine died mid-run: one line, and out at once (the data-loader workers notice and exit too)."""
    print(f"error: {reason}; the checkpoints so far are kept in {out}: rerun the same command to resume",
          file=sys.stderr, flush=True)
    os._exit(1)


def spool_of(out, p):
    """The one folder an engine's answers are used in: `<output-dir>/.online` for the engine stage 04 starts, or the
    --engine-spool an engine at --engine-address writes to."""
    return p.spool or os.path.join(out, SPOOL)


def prepare(out, p):
    """Rank 0, before the engine starts and before the other ranks read anything: the spool emptied of engine files
    (it holds only files in flight: a killed run's are stale; anything else there stays), the cache recounted, logs/
    made."""
    from .extract_output import clear_spool
    spool = spool_of(out, p) if p.spool else outdir.make_dir(os.path.join(out, SPOOL))
    clear_spool(spool)
    outdir.make_dir(os.path.join(out, "logs"))
    cache_dir = os.path.join(out, CACHE)
    files, used = prepare_cache(cache_dir, p.cache_bytes)
    if p.cache_bytes:
        log.info(f"sample cache {cache_dir}: {files} files, {used / 1e9:.2f} of {p.cache_bytes / 1e9:.2f} GB")
