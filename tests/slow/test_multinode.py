"""Stage 04 past one node, as far as one CPU machine can show it: two torchrun agents, each a node of one rank
(`--nnodes 2`), meeting at a c10d rendezvous on localhost, their ranks joined by gloo (adapters.cpu_without_accelerator
makes speculators' distributed set-up work without an accelerator). The run trains, stops on SIGTERM sent to both
agents (what a scheduler does to a job) with an `interrupted` checkpoint, and the same two commands resume it from
the step it reached, as one process does (tests/reliability/test_stage04_faults.py)."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

from conftest import REPO, train_args

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(argv, logs, run_id):
    """Two torchrun agents, node ranks 0 and 1, one training process each, in their own sessions."""
    port = _free_port()
    procs = []
    for k, log in enumerate(logs):
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(k), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--max-restarts", "0", *argv]
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
                                      start_new_session=True))
    return procs


def _wait(procs, timeout):
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            raise
    return codes


def test_two_nodes_train_stop_on_sigterm_and_resume(stages, model_path, tmp_path):
    out = tmp_path / "draft"
    argv = train_args(model_path, stages, out, "--epochs", "2", "--total-seq-len", "512")
    logs = [tmp_path / "node0.err", tmp_path / "node1.err"]
    procs = _nodes(argv, logs, "first")
    deadline, target, text = time.time() + 400, None, ""
    while time.time() < deadline and all(p.poll() is None for p in procs):
        text = "".join(f.read_text() for f in logs)
        steps = re.findall(r"step (\d+)/(\d+)", text)
        if steps and target is None:
            target = int(steps[0][1]) // 2 + 2  # the second step of the second epoch
        if steps and int(steps[-1][0]) >= target:
            break
        time.sleep(0.2)
    assert target is not None and all(p.poll() is None for p in procs), text[-4000:]
    for p in procs:  # a scheduler's stop: SIGTERM to every task of the job
        os.killpg(p.pid, signal.SIGTERM)
    codes = _wait(procs, 300)
    first = "".join(f.read_text() for f in logs)
    stopped_at = max(int(s) for s in re.findall(r"step (\d+)/", first))
    assert all(c != 0 for c in codes) and "SIGTERM: stopping; an `interrupted` checkpoint is saved" in first, \
        (codes, first[-4000:])
    for log in logs:  # one process group of two ranks, one on each node (speculators' own line)
        assert "Started distributed with local_rank=0, dp_size=2" in log.read_text(), log.read_text()[-3000:]
    assert not (out / "manifest.json").exists()
    assert (out / "interrupted" / "training_state.json").exists(), sorted(os.listdir(out))
    total = int(re.findall(r"step \d+/(\d+)", first)[0])

    logs = [tmp_path / "again0.err", tmp_path / "again1.err"]
    codes = _wait(_nodes(argv, logs, "again"), 600)
    again = [f.read_text() for f in logs]
    assert codes == [0, 0], (codes, again[0][-3000:], again[1][-3000:])
    both = "".join(again)
    assert "resuming from the interrupted checkpoint" in both, both[-3000:]
    steps = [int(s) for s in re.findall(r"step (\d+)/", both)]
    assert steps[0] == stopped_at + 1, (stopped_at, steps)
    manifest = json.load(open(out / "manifest.json"))
    assert manifest["steps"] == total, (manifest["steps"], total)
