"""The fault cases too slow for the default set: stage 02 killed at load, mid-batch, between batches and at the end; stage 04 killed
while a checkpoint is written and with the old checkpoint deleted and the new one not yet in place, and stopped by SIGKILL or SIGTERM mid-training;
stage 04 --online with an HF or a vLLM engine killed and resumed."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_script, train_args
from faults import online_killed_and_resumed, stage02_killed_at, stage04_killed_in_save


@pytest.mark.parametrize("point", ["load", "batch", "between", "end"])
def test_stage02_sigkill_then_rerun_completes(stages, model_path, tmp_path, point):
    stage02_killed_at(point, stages, model_path, tmp_path)


@pytest.mark.parametrize("point", ["save:2", "publish:1"])
def test_stage04_killed_inside_a_checkpoint_save_then_the_same_command_resumes(stages, model_path, tmp_path, point):
    """Killed while the second checkpoint is written, and in the window between deleting the old copy and renaming
    the new one (the default set's tests/reliability/test_stage04_faults.py stops a run by Ctrl-C mid-epoch)."""
    stage04_killed_in_save(point, stages, model_path, tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_signal_during_training_then_resume(stages, model_path, tmp_path, sig):
    """SIGKILL loses the steps since the last checkpoint; SIGTERM lets speculators save an `interrupted` one. Either
    way the same command resumes with the step count continuing, never from step 1."""
    out = tmp_path / "draft"
    argv = train_args(model_path, stages, out, "--epochs", "3", "--checkpoint-freq", "0.5")
    err = open(tmp_path / "first.err", "w")  # a file, not a pipe: a full pipe would stall the child
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # each step line as it happens
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "last").exists():
        time.sleep(0.2)
    assert (out / "last").exists(), "no checkpoint appeared"
    proc.send_signal(sig)
    rc = proc.wait(timeout=300)
    err.close()
    first = (tmp_path / "first.err").read_text()
    assert rc != 0 and not (out / "manifest.json").exists(), first[-2000:]
    stopped_at = max(int(s) for s in re.findall(r"step (\d+)/", first))
    p, _ = run_script(*argv)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Resuming" in p.stderr
    steps = [int(s) for s in re.findall(r"step (\d+)/", p.stderr)]
    assert steps and 1 < steps[0] <= stopped_at + 1
    man = json.load(open(out / "manifest.json"))
    assert man["steps"] == int(re.findall(r"step \d+/(\d+)", p.stderr)[0])


def test_online_hf_kill_resume_cache_and_skipped_sample(small, model_path, tmp_path):
    online_killed_and_resumed("hf", small, model_path, tmp_path)


def test_online_vllm_kill_resume_cache_and_skipped_sample(small, model_path, tmp_path):
    online_killed_and_resumed("vllm", small, model_path, tmp_path, epochs=2)
