"""scripts/extract.sh (eagle3pipe/extract/launch.py) under the stages' rules, through the operator's command: `--help` and
`--dry-run` start nothing and write nothing; a link or hard link planted at its log or PID file, a bad environment
number, an unreadable input: one line, exit 2, nothing heavy imported, nothing written, the file outside unchanged;
a stage that stops at once is named by its log's error line and gets no PID file; of two launches at the same moment
exactly one starts. REPLICAS=2 running to completion: tests/slow/test_launcher.py."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import REPO, assert_refused, snapshot

# as root, permission bits do not stop a read: drop the capabilities that bypass them, as an operator has none
NO_BYPASS = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


def launch(*args, env=None, prefix=(), timeout=120, cwd=REPO):
    """`bash scripts/extract.sh ARGS` -> CompletedProcess with `heavy`: the heavy libraries it imported
    (tests/importwatch)."""
    fd, log = tempfile.mkstemp(prefix="imports-")
    os.close(fd)
    e = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": os.path.join(REPO, "tests", "importwatch"),
         "EAGLE3_TEST_IMPORT_LOG": log, **(env or {})}
    try:
        p = subprocess.run([*prefix, "bash", os.path.join(REPO, "scripts", "extract.sh"), *args], cwd=cwd, env=e,
                           capture_output=True, text=True, timeout=timeout)
        with open(log) as f:
            p.heavy = list(dict.fromkeys(f.read().split()))
    finally:
        os.unlink(log)
    return p


def alive(pid):
    """Running (not gone, not a zombie left for an init that may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def base(model_path, prep, out):
    return ["--backend", "hf", "--model-path", model_path, "--prepared-data", str(prep), "--output-dir", str(out),
            "--max-seq-len", "256"]


def test_a_module_in_the_folder_it_is_launched_from_does_not_run(model_path, prep, tmp_path):
    """`python -m` puts the current folder first on the module path: a json.py (or another checkout's eagle3pipe/)
    where the operator stands ran in the launcher's place."""
    here = tmp_path / "here"
    (here / "eagle3pipe").mkdir(parents=True)
    planted = f"open({str(tmp_path / 'ran')!r}, 'w').close()\nraise SystemExit('shadowed')\n"
    (here / "json.py").write_text(planted)
    (here / "eagle3pipe" / "__init__.py").write_text(planted)
    # PYTHONSAFEPATH (Python 3.11+) keeps the current folder off the path itself: the package's own entry must stay
    for env in ({}, {"PYTHONSAFEPATH": "1"}):
        p = launch(*base(model_path, prep, tmp_path / "hs"), "--dry-run", cwd=here, env=env)
        assert p.returncode == 0 and "plan:" in p.stdout, (env, p.stdout + p.stderr)
    assert not (tmp_path / "ran").exists()


def test_help_once_and_dry_run_start_and_write_nothing(model_path, prep, tmp_path):
    out = tmp_path / "hs"
    p = launch("--help", *base(model_path, prep, out))
    assert p.returncode == 0 and p.stdout.count("usage:") == 1 and "--prepared-data" in p.stdout, p.stderr
    assert "REPLICAS" in p.stdout and "TP_SIZE" in p.stdout and not p.stderr.strip(), p.stderr
    p = launch(*base(model_path, prep, out), "--dry-run")
    assert p.returncode == 0 and "plan:" in p.stdout and "nothing started" in p.stdout, p.stderr
    assert "started PID" not in p.stdout and not out.exists(), p.stdout
    assert "  weights: 272 tensors" in p.stdout and "vllm" not in p.heavy and "speculators" not in p.heavy, p.heavy


def test_relative_paths_are_taken_from_where_the_operator_is(model_path, prep, tmp_path):
    # the script once ran from the repository: `--prepared-data prep` typed in /data/run was not found, and a
    # relative --output-dir would have been made inside the checkout
    here = tmp_path / "run"
    here.mkdir()
    os.symlink(prep, here / "prep")
    p = launch("--backend", "hf", "--model-path", model_path, "--prepared-data", "prep", "--output-dir", "hs",
               "--max-seq-len", "256", "--dry-run", cwd=here)
    assert p.returncode == 0 and "plan:" in p.stdout and "nothing started" in p.stdout, p.stderr
    assert sorted(os.listdir(here)) == ["prep"] and not os.path.exists(os.path.join(REPO, "hs"))


PLANTS = {  # name in the output folder -> how it is planted there, pointing at the sentinel outside
    "log-symlink": ("extract.log", os.symlink),
    "pid-symlink": ("extract.pid", os.symlink),
    "log-hardlink": ("extract.log", os.link),
    "pid-hardlink": ("extract.pid", os.link),
    "replica-pid-symlink": ("extract.shard-1.pid", os.symlink),
}
ENVS = {  # the launcher's environment numbers
    "replicas-word": ({"REPLICAS": "two"}, "REPLICAS=two"),
    "replicas-zero": ({"REPLICAS": "0"}, "REPLICAS=0"),
    "tp-negative": ({"TP_SIZE": "-1"}, "TP_SIZE=-1"),
    "batch-fraction": ({"BATCH_SIZE": "1.5"}, "BATCH_SIZE=1.5"),
    "replicas-over-gpus": ({"REPLICAS": "3", "CUDA_VISIBLE_DEVICES": "0,1"}, "REPLICAS=3"),
    "python-not-python": ({"PYTHON": "/bin/false"}, "PYTHON=/bin/false: not a Python 3.9+ interpreter"),
}


@pytest.mark.parametrize("case", list(PLANTS) + list(ENVS))
def test_refusals_are_one_line_and_write_nothing(case, model_path, prep, tmp_path):
    out, sentinel = tmp_path / "hs", tmp_path / "users_file"
    sentinel.write_bytes(b"a user's file\n")
    env, needle = ENVS.get(case, ({}, None))
    if case in PLANTS:
        name, plant = PLANTS[case]
        out.mkdir()
        plant(sentinel, out / name)
        needle = f"{name}: {'a link' if plant is os.symlink else 'a hard link'}"
        if name.startswith("extract.shard"):
            env = {"REPLICAS": "2", "CUDA_VISIBLE_DEVICES": "0,1"}
    before = snapshot(tmp_path)
    p = launch(*base(model_path, prep, out), env=env)
    assert_refused(p, 0, needle)
    assert snapshot(tmp_path) == before and "started" not in p.stdout


@pytest.mark.parametrize("which", ["tokenized_data.jsonl", "manifest.json", "config.json"])
def test_an_unreadable_input_is_refused_by_the_launcher_and_by_the_dry_run(which, model_path, prep, tmp_path):
    if NO_BYPASS and not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: permission bits cannot be made to apply")
    data, model = tmp_path / "prepared", tmp_path / "model"
    shutil.copytree(prep, data)
    model.mkdir()
    for name in os.listdir(model_path):  # the verifier's files, by link, but for the one made unreadable
        os.symlink(os.path.join(model_path, name), model / name)
    target = model / which if which == "config.json" else data / which
    if target.is_symlink():
        target.unlink()
        shutil.copy(os.path.join(model_path, which), target)
    out = tmp_path / "hs"
    argv = ["--backend", "hf", "--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out),
            "--max-seq-len", "256"]
    before = snapshot(tmp_path)
    target.chmod(0)
    try:
        assert_refused(launch(*argv, prefix=NO_BYPASS), 0, which)
        e = {**os.environ, "PYTHONPATH": os.path.join(REPO, "tests", "importwatch")}
        p = subprocess.run([*NO_BYPASS, sys.executable, "02_extract_hidden_states.py", *argv, "--dry-run"], cwd=REPO,
                           env=e, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and which in p.stderr.strip().splitlines()[-1], p.stderr
    finally:
        target.chmod(0o644)
    assert snapshot(tmp_path) == before and not out.exists()


def test_a_stage_that_stops_at_once_is_named_and_gets_no_pid_file(model_path, prep, tmp_path):
    data = tmp_path / "prepared"
    shutil.copytree(prep, data)
    rows = (data / "tokenized_data.jsonl").read_text().splitlines(keepends=True)
    rows[2] = '{"input_ids": [1, 2], "loss_mask": [1]}\n'  # stage 01's manifest still vouches for it: the run finds it
    (data / "tokenized_data.jsonl").write_text("".join(rows))
    out = tmp_path / "hs"
    p = launch(*base(model_path, data, out))
    # the launcher's preflight checked the verifier's weights (torch, transformers); no engine started
    line = assert_refused(p, 0, "stopped", "exit 2", "tokenized_data.jsonl:3: malformed row", "extract.log",
                          weights_checked=True)
    assert "started PID" not in p.stdout and not (out / "extract.pid").exists(), line
    assert "malformed row" in (out / "extract.log").read_text()


def test_two_launches_at_once_exactly_one_starts(model_path, prep, tmp_path):
    """The one launch in the default set that starts a stage: stopped as soon as it is confirmed running."""
    out = tmp_path / "hs"
    env = {**os.environ, "PYTHON": sys.executable}
    cmd = ["bash", "scripts/extract.sh", *base(model_path, prep, out)]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    won = [r for r in results if r[0] == 0]
    lost = [r for r in results if r[0] != 0]
    assert len(won) == 1 and len(lost) == 1, results
    pid = int((out / "extract.pid").read_text())
    try:
        assert f"started PID {pid}" in won[0][1] and f"kill -TERM -- -{pid}" in won[0][1], won
        errors = [line for line in lost[0][2].splitlines() if line.strip()]
        assert lost[0][0] == 2 and len(errors) == 1 and f"in use by another run (PID {pid} " in errors[0], lost
        assert "started" not in lost[0][1]
        assert os.getsid(pid) == pid  # its own session and process group: `kill -TERM -- -PID` reaches all of it
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + 30
    while alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    # its log and PID file are recorded as the launcher's: a later launch takes them back (here, its preflight)
    p = launch(*base(model_path, prep, out), "--dry-run")
    assert p.returncode == 0 and "all checks passed" in p.stdout, p.stderr
