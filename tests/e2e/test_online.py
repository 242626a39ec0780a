"""Stage 04 --online end to end on the embedded default: the vLLM engine, a SIGKILL mid-run and the same command
resuming, a poisoned sample skipped and counted, no file left beyond the cache budget, and the engine and loader
workers gone with the killed run; the HF engine dying mid-run ends the run with one line."""
import json
import os
import re
import socket
import signal
import subprocess
import sys
import time


from conftest import REPO, run_script

def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def online_args(model_path, d, out, *extra):
    return ["04_train.py", "--online", "--model-path", model_path, "--prepared-data", str(d["prepared"]),
            "--vocab-mapping", str(d["vocab"]), "--output-dir", str(out), "--total-seq-len", "1024", "--log-every",
            "1", *extra]


def _pids_alive(pids):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] != "Z":
                    alive.append(pid)
        except (ProcessLookupError, FileNotFoundError):
            pass
    return alive


def _children(pid):
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
    pairs = [tuple(map(int, line.split())) for line in out if line.strip()]
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in pairs if pp == p]
        found += kids
        todo += kids
    return found


def test_online_vllm_kill_resume_cache_and_skipped_sample(small, model_path, tmp_path):
    """The default engine (vLLM) on CPU, two epochs with a cache smaller than the data: SIGKILL after the first
    mid-epoch checkpoint takes the engine and the loader workers with it; the same command resumes from that
    checkpoint; a sample whose states come back non-finite is skipped and counted; the second epoch reads the cached
    samples; nothing is left beyond the budget."""
    out = tmp_path / "draft"
    budget_gb = 0.01  # the 12 rows hold about 27 MB of states: a third fits
    argv = online_args(model_path, small, out, "--epochs", "2", "--checkpoint-freq", "0.5", "--cache-gb",
                       str(budget_gb))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EAGLE3_INJECT_NAN_ROWS": "3"}
    err = open(tmp_path / "first.err", "w")
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, env=env)
    deadline = time.time() + 600
    while time.time() < deadline and not (out / "last").exists() and proc.poll() is None:
        time.sleep(0.2)
    assert (out / "last").exists(), (tmp_path / "first.err").read_text()[-3000:]
    family = _children(proc.pid)
    assert family, "no engine or loader processes seen"
    proc.kill()
    proc.wait(60)
    err.close()
    first = (tmp_path / "first.err").read_text()
    stopped_at = max(int(s) for s in re.findall(r"step (\d+)/", first))
    deadline = time.time() + 30
    while _pids_alive(family) and time.time() < deadline:
        time.sleep(0.5)
    assert not _pids_alive(family), "the engine or a loader worker outlived the killed run"

    p = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "Resuming" in p.stderr
    steps = [int(s) for s in re.findall(r"step (\d+)/", p.stderr)]
    assert steps and 1 < steps[0] <= stopped_at + 1
    man = json.load(open(out / "manifest.json"))
    assert man["online"]["mode"] == "cached" and man["online"]["skipped_samples"] == 1
    assert man["inputs"]["hidden_states"] == "online" and man["layer_ids"] == [2, 15, 27, 30]
    assert 0 < man["online"]["cache_bytes"] <= budget_gb * 1e9
    assert json.loads((out / "logs" / "skipped.jsonl").read_text().splitlines()[0])["row"] == 3
    hs = [os.path.join(d, n) for d, _, names in os.walk(out) for n in names if n.endswith(".safetensors")
          and not n.startswith("model")]
    assert all("hidden_states_cache" in f for f in hs) and sum(os.path.getsize(f) for f in hs) <= budget_gb * 1e9
    assert os.listdir(out / ".online") == []
    assert os.path.isfile(out / "last" / "config.json")


def test_online_hf_engine_death_stops_the_run_with_one_line(small, model_path, tmp_path):
    out = tmp_path / "draft"
    argv = online_args(model_path, small, out, "--backend", "hf", "--epochs", "3")
    err = open(tmp_path / "err", "w")
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline, pid = time.time() + 300, None
    while time.time() < deadline and pid is None:
        m = re.search(r"extraction engine \(hf, pid (\d+)\) ready", (tmp_path / "err").read_text())
        pid = int(m.group(1)) if m else None
        time.sleep(0.5)
    assert pid, (tmp_path / "err").read_text()[-3000:]
    while time.time() < deadline and "step 1/" not in (tmp_path / "err").read_text():
        time.sleep(0.5)
    family = [c for c in _children(proc.pid) if c != pid]  # the loader workers
    os.kill(pid, signal.SIGKILL)
    rc = proc.wait(120)
    err.close()
    text = (tmp_path / "err").read_text()
    assert rc == 1, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, text[-3000:]
    assert errors[0].startswith("error: the extraction engine exited with code -9") and "rerun the same command" in \
        errors[0]
    deadline = time.time() + 30
    while _pids_alive(family) and time.time() < deadline:
        time.sleep(0.5)
    assert not _pids_alive(family)


def test_external_engine_with_other_layers_is_refused_before_training(small, model_path, tmp_path):
    """An engine at --engine-address that stores other layers than this run needs: one line after its first answer,
    before any training (and the engine, not ours, keeps running)."""
    port = closed_port()
    log = open(tmp_path / "engine.log", "w")
    engine = subprocess.Popen([sys.executable, "-m", "eagle3pipe.hf_server", "--model-path", model_path, "--layer-ids",
                               "2,15,30", "--spool", str(tmp_path / "spool"), "--port", str(port)], cwd=REPO,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while "serving" not in (tmp_path / "engine.log").read_text() and time.time() < deadline:
            assert engine.poll() is None, (tmp_path / "engine.log").read_text()
            time.sleep(0.5)
        p, _ = run_script(*online_args(model_path, small, tmp_path / "ck", "--engine-address", f"127.0.0.1:{port}",
                                      "--engine-spool", str(tmp_path / "spool")))
        errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
        assert p.returncode == 1 and len(errors) == 1, p.stderr[-3000:]
        assert "stores hidden states of shape [16, 3, 576]" in errors[0] and "[16, 4, 576]" in errors[0]
        assert "step " not in p.stderr and engine.poll() is None
        assert os.listdir(tmp_path / "spool") == []  # the probe's file was read and deleted
    finally:
        engine.kill()
        log.close()
