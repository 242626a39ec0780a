"""No child outlives its stage (eagle3pipe/base/lifeline.py): a stage killed with SIGKILL, at any point, leaves no process
behind, whether the process ignores SIGTERM, sits in a session of its own, was orphaned before the stage died or was
started a moment before. Real processes; the stage is a small script that starts the lifeline as the stages do."""
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from conftest import REPO, killed_at, left_behind, marked_processes, online_args, reached
from eagle3pipe.base import lifeline

STAGE = """
import os, subprocess, sys, time
sys.path.insert(0, {repo!r})
from eagle3pipe.base import lifeline
lifeline.start()
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
# a child that ignores SIGTERM
subprocess.Popen([sys.executable, "-c", stubborn])
# a grandchild in a session of its own, orphaned while the stage lives (its parent exits at once)
subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', %r], "
                "start_new_session=True)" % stubborn])
# a child whose own child ignores SIGTERM (an engine and its worker)
subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', %r]); "
                  "time.sleep(600)" % stubborn])
print("started", flush=True)
time.sleep(float(sys.argv[1]))
subprocess.Popen([sys.executable, "-c", stubborn])  # started a moment before the stage is killed
print("last", flush=True)
time.sleep(float(sys.argv[2]))  # then it ends, normally
"""


def _stage(tmp_path, mark, pause, rest):
    script = tmp_path / "stage.py"
    script.write_text(STAGE.format(repo=REPO))
    env = {**os.environ, "EAGLE3_TEST_MARK": mark, "EAGLE3_LIFELINE_GRACE": "1"}
    proc = subprocess.Popen([sys.executable, str(script), str(pause), str(rest)], stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout.readline().strip() == "started"
    return proc


def _watchdog(mark, stage_pid):
    """The stage's watchdog: `python -I -S .../lifeline.py <stage pid> <token> <fd>`."""
    for pid, cmd in marked_processes(mark):
        if cmd.split()[-4].endswith(os.path.join("eagle3pipe", "base", "lifeline.py")) and cmd.split()[-3] == str(stage_pid):
            return pid
    return None


def test_a_stage_killed_leaves_no_process_behind(tmp_path):
    mark = uuid.uuid4().hex
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 env={**os.environ, "EAGLE3_TEST_MARK": "bystander-" + mark})
    stage = _stage(tmp_path, mark, pause=0.3, rest=600)
    try:
        assert stage.stdout.readline().strip() == "last"
        deadline = time.time() + 30  # the stage, its watchdog, five children and grandchildren
        while len(marked_processes(mark)) < 7 and time.time() < deadline:
            time.sleep(0.05)
        watchdog = _watchdog(mark, stage.pid)
        assert watchdog
        assert len(marked_processes(mark)) == 7
        stage.kill()
        stage.wait()
        assert left_behind(mark) == []
        assert lifeline.stat(watchdog) is None  # its work done, the watchdog is gone too (or a zombie, unreaped)
        assert bystander.poll() is None  # a process that is not the stage's is never signalled
    finally:
        bystander.kill()
        bystander.wait()
        if stage.poll() is None:
            stage.kill()


def test_a_stage_that_ends_normally_takes_its_children_with_it(tmp_path):
    """The watchdog also ends what an exiting stage forgot, and holds nothing of the stage meanwhile: no terminal,
    no log, no lock, no working folder."""
    mark = uuid.uuid4().hex
    stage = _stage(tmp_path, mark, pause=1, rest=0)
    watchdog = _watchdog(mark, stage.pid)
    fds = {int(fd): os.readlink(f"/proc/{watchdog}/fd/{fd}") for fd in os.listdir(f"/proc/{watchdog}/fd")}
    assert [fds[k] for k in (0, 1, 2)] == [os.devnull] * 3
    assert all(t.startswith("pipe:") for k, t in fds.items() if k > 2) and len(fds) == 4, fds
    assert os.readlink(f"/proc/{watchdog}/cwd") == "/"
    assert os.getsid(watchdog) == watchdog  # a signal to the stage's group does not reach it
    assert stage.stdout.readline().strip() == "last"
    assert stage.wait(30) == 0
    assert left_behind(mark) == []


def test_stage04_killed_while_its_hf_engine_loads_leaves_nothing(small, model_path, tmp_path):
    """Through the real entry point: stage 04 --online sent SIGTERM, then SIGKILL a second later, while the engine it
    started loads the model (the rest of the points, and stage 05's vLLM engine, are in tests/slow/test_no_orphans.py)."""
    argv = online_args(model_path, small, tmp_path / "draft", "--backend", "hf", "--epochs", "2")
    assert killed_at(argv, "hf-loading", tmp_path, term_first=True) == []



@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_stop_signal_while_vllm_starts_ends_the_stage_at_once(sig, stages, trained, model_path, tmp_path):
    """vLLM's start swallowed the exception a handler raised: SIGTERM hung 10 minutes in its handshake then failed as
    a timeout (exit 1), and Ctrl-C was ignored (the run went on and exited 0). Now: one line, 128 + the signal, within
    seconds, and nothing of the engine left."""
    out, _ = trained
    mark, err = uuid.uuid4().hex, tmp_path / "err"
    argv = ["05_evaluate.py", "--model-path", model_path, "--draft", str(out / "last"), "--prepared-data",
            str(stages["prepared"]), "--output-dir", str(tmp_path / "ev"), "--num-prompts", "2", "--max-new-tokens",
            "8", "--batch-sizes", "1", "--measure", "off"]
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=f,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "EAGLE3_TEST_MARK": mark})
    try:
        deadline = time.time() + 300
        while not reached("engine-core", err, mark):
            assert proc.poll() is None and time.time() < deadline, err.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(sig)
        rc = proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    lines = [l for l in err.read_text().splitlines() if l.startswith("error:")]
    assert rc == 128 + sig, (rc, err.read_text()[-3000:])
    assert lines == [f"error: stopped by a signal ({signal.Signals(sig).name}) while the vLLM engine started; rerun "
                     f"the same command: stage 05 measures again from the start, and the earlier report stays until "
                     f"the new one is complete"], lines
    assert left_behind(mark, 60) == []
