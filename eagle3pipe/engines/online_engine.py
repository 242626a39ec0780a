"""The extraction engine stage 04 --online trains from: the one it starts (vLLM's OpenAI server with the
hidden-states connector, or the HF backend's server) or one already running at --engine-address. Started, waited
on with a deadline, probed with one short request before training, watched while training runs, and stopped with
its process group. No engine outlives stage 04: the lifeline watchdog before it starts, a parent-death signal and
its own session.
"""
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from . import engines
from ..base import devices, lifeline
from ..base.errors import RunError
from ..base.inherited import child_pythonpath
from ..formats.hidden_states import read_header
from ..formats.spool import remove_spool_file, wait_for_engine_file
from ..storage import outdir
from .engine import connector_config, cpu_vllm_env, get_json, server_module, verifier_compilation
from .engine_log import last_error, open_log

log = logging.getLogger("eagle3")


ENGINE_LOG = "engine.log"


def launch(s, p, out, probe_ids, spool):
    """Start the engine stage 04 owns (or point at --engine-address), wait until it answers, and check its first
    answer (`probe_ids`: a few tokens of the first row) in `spool`, the one folder its files are used in.
    `s`: settings.Train; `p`: online_plan.OnlinePlan. -> a Server."""
    engine = Server(f"http://{p.address}/v1") if p.address else _start(s, p, out, spool)
    try:
        engine.probe(s.model_path, probe_ids, p.n_states, p.hidden_size, spool)
    except RunError:
        engine.stop()
        raise
    return engine


def _start(s, p, out, spool):
    env = dict(os.environ)
    env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH"))  # our connector and hf_server import from here
    env["PYTHONSAFEPATH"] = "1"  # `python -m` puts the current folder first: a json.py there would run in the engine
    devices.set_visible(env, p.engine_cvd if p.on_gpu else "")
    if not p.on_gpu:
        cpu_vllm_env(env)
    cmd = engine_command(s, p.layer_ids, spool, p.port, p.max_len, p.tp, p.memory, p.on_gpu, p.dtype)
    engine = Server.start(cmd, env, os.path.join(out, ENGINE_LOG), p.port)
    took = engine.wait_ready(s.engine_timeout)
    log.info(f"extraction engine ({s.backend}, pid {engine.proc.pid}) ready in {took:.0f} s at {engine.url}; its "
             f"log: {engine.log_path}")
    return engine


def engine_command(s, layer_ids, spool, port, max_len, tp, memory, on_gpu, dtype):
    server = engines.kind(s.backend).server
    if server:  # ours: the same two API calls as vLLM's server
        cmd = [sys.executable, "-m", server, "--model-path", s.model_path, "--layer-ids",
               ",".join(map(str, layer_ids)), "--spool", spool, "--port", str(port), "--dtype", dtype]
        return cmd + (["--trust-remote-code"] if s.trust_remote_code else [])
    cmd = [sys.executable, "-m", server_module(), "--model", s.model_path, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_len), "--no-enable-prefix-caching",
           "--tensor-parallel-size", str(tp), "--gpu-memory-utilization", str(memory),
           "--speculative-config", json.dumps({"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                               "draft_model_config": {"hf_config": {
                                                   "eagle_aux_hidden_state_layer_ids": layer_ids}}}),
           "--kv-transfer-config", json.dumps(connector_config(spool, on_gpu))]
    if not on_gpu:
        comp = verifier_compilation(s.model_path)
        cmd += ["--enforce-eager"] + (["--compilation-config", json.dumps(comp)] if comp else [])
    return cmd + (["--trust-remote-code"] if s.trust_remote_code else [])


def _die_with(parent):
    """-> the function the engine's process runs before exec: SIGTERM when stage 04 (`parent`) dies, so no engine
    outlives it (holding its GPUs and port), and out at once if it died before that was set; its own session and
    process group, stopped as a whole and untouched by the terminal's Ctrl-C. An engine that ignores SIGTERM while
    it starts is ended by stage 04's lifeline (SIGKILL after lifeline.GRACE s)."""
    try:  # loaded here: an import between fork and exec can deadlock on a lock another thread held
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None

    def child():
        if prctl is not None:
            prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)
        os.setsid()
    return child


class Server:
    """The extraction engine stage 04 runs (or one at --engine-address): start, wait until it answers, watch it."""

    def __init__(self, url, proc=None, log_path=None):
        self.url, self.proc, self.log_path, self.stopping = url, proc, log_path, False

    @classmethod
    def start(cls, cmd, env, log_path, port):
        """Start the engine from the main thread (a parent-death signal follows the thread that forked)."""
        lifeline.start()
        f = os.fdopen(open_log(log_path), "ab")  # never through a link planted at that name
        f.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=lifeline.marked(dict(env)),
                                preexec_fn=_die_with(os.getpid()))
        f.close()
        return cls(f"http://127.0.0.1:{port}/v1", proc, log_path)

    def last_line(self):
        """The root cause the engine's log names (engine_log.py), else its last line."""
        cause = last_error(self.log_path) if self.log_path else ""
        if cause:
            return cause
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
                raise RunError(f"the extraction engine exited with code {self.proc.returncode} while loading: "
                               f"{self.last_line()}; its log: {self.log_path}")
            try:
                get_json(self.url + "/models", 2)
                return time.time() - t0
            except (OSError, ValueError):
                time.sleep(1)
        raise RunError(f"the extraction engine did not answer at {self.url} within --engine-timeout {timeout} s; see "
                       f"{self.log_path}")

    def probe(self, model, token_ids, n_states, hidden, spool):
        """One short request before training: the engine answers with a file this process can read, holding
        [T, n_states, hidden] states for exactly these tokens. An engine storing other layers (another --layer-ids,
        another model) or writing where this machine cannot read is refused here, not after the first batch."""
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
            remove_spool_file(spool, path)
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
                        return on_death(f"exited with code {self.proc.returncode}: {self.last_line()}; its log: "
                                        f"{self.log_path}")
                    continue
                try:
                    get_json(self.url + "/models", 5)
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
