"""Fault scenarios run by two tiers with different points: reliability/ (the default set) and slow/ (the rest)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

from conftest import REPO, online_args, rows_of, run_script, train_args
from eagle3pipe.formats.hidden_states import check_file, hs_path


def cmd(model_path, prep, out, *extra):
    return ["02_extract_hidden_states.py", "--backend", "hf", "--model-path", model_path, "--prepared-data",
            str(prep), "--output-dir", str(out), "--max-seq-len", "512", "--batch-size", "2", *extra]


def assert_complete(prep, out, n_states=4, hidden=576):
    rows = [r["input_ids"] for r in rows_of(prep)]
    names = sorted(os.listdir(out))
    assert not [n for n in names if ".tmp-" in n], names  # no temporary file left behind
    assert len([n for n in names if n.startswith("hs_")]) == len(rows)  # one file per row, nothing else
    for i, r in enumerate(rows):
        assert check_file(hs_path(out, i), r, n_states, hidden) is None, i
    m = json.load(open(os.path.join(out, "manifest.json")))
    assert m["complete"] and m["counts"]["ok"] == len(rows) and m["counts"]["failed"] == 0
    assert m["counts"]["resumed"] + m["counts"]["extracted"] == len(rows)
    return m


def stage02_killed_at(point, stages, model_path, tmp_path):
    """SIGKILL at a named point of stage 02 (eagle3pipe/base/faults.py), then the same command completes, keeping what
    the killed run finished."""
    out = tmp_path / "hs"
    n_hit = "2" if point in ("batch", "write", "between") else "1"  # mid-run, not on the first batch
    p, _ = run_script(*cmd(model_path, stages["prepared"], out),
                      env=dict(os.environ, EAGLE3_INJECT_KILL=f"{point}:{n_hit}"))
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])
    assert not (out / "manifest.json").exists()
    before = {n for n in os.listdir(out) if n.startswith("hs_")}
    if point == "write":
        assert any(".tmp-" in n for n in os.listdir(out))  # the half-written file never got its final name
    if point == "end":
        assert len(before) == len(rows_of(stages["prepared"]))
    p, _ = run_script(*cmd(model_path, stages["prepared"], out))
    assert p.returncode == 0, p.stderr[-2000:]
    m = assert_complete(stages["prepared"], out)
    assert m["counts"]["resumed"] == len(before)  # what the killed run finished is kept, not redone


def stage04_killed_in_save(point, stages, model_path, tmp_path):
    """SIGKILL with the second checkpoint half written (`save`), or with the previous copy deleted and the new one
    not yet renamed into place (`publish`): the rerun finds the last whole checkpoint and goes on from it."""
    out = tmp_path / "draft"
    # mid-epoch checkpoints too: the end of an epoch then replaces its mid-epoch checkpoint (the `publish` window)
    argv = train_args(model_path, stages, out, "--epochs", "2", "--checkpoint-freq", "0.5", "--total-seq-len", "512")
    p, _ = run_script(*argv, env={"EAGLE3_INJECT_KILL": point})
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    p, _ = run_script(*argv)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Resuming" in p.stderr and "Starting fresh" not in p.stderr, p.stderr[-3000:]
    assert json.load(open(out / "manifest.json"))["steps"] == int(re.findall(r"step \d+/(\d+)", p.stderr)[0])
    assert os.listdir(out / ".saving") == [] and os.path.realpath(out / "last") == str(out / "1")


def pids_alive(pids):
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


def children(pid):
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
    pairs = [tuple(map(int, line.split())) for line in out if line.strip()]
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in pairs if pp == p]
        found += kids
        todo += kids
    return found


def online_killed_and_resumed(backend, small, model_path, tmp_path, epochs=1):
    """An extraction engine (`backend`) on CPU, `epochs` epochs with a cache smaller than the data: SIGKILL after the
    first mid-epoch checkpoint takes the engine and the loader workers with it; the same command resumes from that
    checkpoint; a sample whose states come back non-finite is skipped and counted; a second epoch reads the cached
    samples; nothing is left beyond the budget."""
    out = tmp_path / "draft"
    budget_gb = 0.01  # the 12 rows hold about 27 MB of states: a third fits
    argv = online_args(model_path, small, out, "--backend", backend, "--epochs", str(epochs), "--checkpoint-freq",
                       "0.5", "--cache-gb", str(budget_gb))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EAGLE3_INJECT_NAN_ROWS": "3"}
    err = open(tmp_path / "first.err", "w")
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, env=env)
    deadline = time.time() + 600
    while time.time() < deadline and not (out / "last").exists() and proc.poll() is None:
        time.sleep(0.2)
    assert (out / "last").exists(), (tmp_path / "first.err").read_text()[-3000:]
    family = children(proc.pid)
    assert family, "no engine or loader processes seen"
    proc.kill()
    proc.wait(60)
    err.close()
    first = (tmp_path / "first.err").read_text()
    stopped_at = max(int(s) for s in re.findall(r"step (\d+)/", first))
    deadline = time.time() + 30
    while pids_alive(family) and time.time() < deadline:
        time.sleep(0.5)
    assert not pids_alive(family), "the engine or a loader worker outlived the killed run"

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
