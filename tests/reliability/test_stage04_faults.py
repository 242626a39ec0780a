"""Stage 04 under faults: SIGKILL or SIGTERM mid-training, then the same command resumes from the last checkpoint
with the step count continuing; a corrupt, truncated or foreign hidden-state file is named before training starts."""
import json
import re
import os
import shutil
import signal
import subprocess
import sys
import time


from conftest import REPO, assert_refused, ended_with_one_line, run_script, train_args


def test_ctrl_c_mid_epoch_resumes_from_the_step_it_reached(stages, model_path, tmp_path):
    """Ctrl-C in the middle of an epoch (no periodic checkpoint there), and a SIGTERM right after it (a supervisor's
    resend): the signal is acknowledged at once, an `interrupted` checkpoint is saved whole, and the same command
    continues from the next step, not from the last epoch boundary and never from step 1."""
    out = tmp_path / "draft"
    argv = train_args(model_path, stages, out, "--epochs", "2", "--total-seq-len", "512", "--num-samples", "12")
    err = open(tmp_path / "first.err", "w")
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # each step line as it happens
    deadline, target = time.time() + 300, None
    while time.time() < deadline and proc.poll() is None:
        steps = re.findall(r"step (\d+)/(\d+)", (tmp_path / "first.err").read_text())
        if steps and target is None:
            target = int(steps[0][1]) // 2 + 2  # the second step of the second epoch
        if steps and int(steps[-1][0]) >= target:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # a quick second signal must not cut the save short
    rc = proc.wait(timeout=300)
    err.close()
    first = (tmp_path / "first.err").read_text()
    stopped_at = max(int(s) for s in re.findall(r"step (\d+)/", first))
    assert rc != 0 and "SIGINT: stopping; an `interrupted` checkpoint is saved" in first, first[-2000:]
    assert not (out / "manifest.json").exists()
    assert (out / "interrupted" / "training_state.json").exists() and not os.path.exists(out / ".saving" / "interrupted")
    p, _ = run_script(*argv)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming from the interrupted checkpoint" in p.stderr, p.stderr[-3000:]
    steps = [int(s) for s in re.findall(r"step (\d+)/", p.stderr)]
    assert steps[0] == stopped_at + 1, (stopped_at, steps)
    assert json.load(open(out / "manifest.json"))["steps"] == int(re.findall(r"step \d+/(\d+)", p.stderr)[0])


def test_a_stop_signal_inside_a_sample_read_stops_the_run_and_no_good_sample_is_counted_bad(stages, model_path,
                                                                                          tmp_path):
    """SIGTERM landing inside a training sample's read (on a CPU the loader reads in the main process, where
    speculators' handler raises its stop): the run stops with an `interrupted` checkpoint, as anywhere else. It was
    taken for an unreadable file: the sample skipped and counted, the stop lost, the run trained to its end (exit 0).
    One run, the cheaper for the default set's budget."""
    out = tmp_path / "draft"
    argv = train_args(model_path, stages, out, "--epochs", "1", "--total-seq-len", "512", "--num-samples", "12")
    p, _ = run_script(*argv, env={"EAGLE3_INJECT_SIGNAL": "read:TERM:4"})
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, p.stderr[-3000:])
    assert "SIGTERM: stopping" in p.stderr and "unreadable" not in p.stderr, p.stderr[-3000:]
    assert (out / "interrupted" / "training_state.json").exists() and not (out / "manifest.json").exists()
    assert not (out / "logs" / "skipped.jsonl").exists() or not (out / "logs" / "skipped.jsonl").read_text().strip()
    # the rerun resumes from `interrupted` as after any stop (test_ctrl_c_mid_epoch_resumes_from_the_step_it_reached)


def test_a_rerun_resumes_only_the_same_run_and_inputs_deleted_under_it_stop_it(stages, model_path, tmp_path):
    """Killed once its first checkpoint is on disk, the run is rerun with another --lr, --total-seq-len and
    --val-ratio: refused in one line naming each (old -> new), before anything loads, nothing written. With
    --overwrite it restarts from step 1; its hidden-state files deleted after that step stop it with one line
    (exit 1): a missing sample is a bad sample, never an empty batch trained on in silence."""
    from conftest import snapshot
    hs = tmp_path / "hs"
    shutil.copytree(stages["hs"], hs)  # deleted below
    d = dict(stages, hs=hs)
    out = tmp_path / "draft"
    first = ["--epochs", "1", "--checkpoint-freq", "0.25"]  # 1,024 tokens a batch: the first save after 2 steps
    p, _ = run_script(*train_args(model_path, d, out, *first), env={"EAGLE3_INJECT_KILL": "save"})
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    before = snapshot(out)
    other = ["--epochs", "1", "--checkpoint-freq", "0.25", "--total-seq-len", "512", "--lr", "2e-3", "--val-ratio", "0.1"]
    assert_refused(*run_script(*train_args(model_path, d, out, *other)), "--total-seq-len 1024 -> 512",
                   "--lr 0.003 -> 0.002", "--val-ratio 0.05 -> 0.1", "--overwrite")
    # the compute dtype is part of what is trained: the one `auto` resolved to here, then the other
    from eagle3pipe.base import compute
    was = compute.resolve("auto", False).dtype
    now = "float32" if was == "bfloat16" else "bfloat16"
    assert_refused(*run_script(*train_args(model_path, d, out, *first, "--epochs", "2", "--dtype", now)),
                   f"--dtype {was} -> {now}", "--overwrite")
    assert snapshot(out) == before
    err = open(tmp_path / "again.err", "w")
    proc = subprocess.Popen([sys.executable, *train_args(model_path, d, out, *other, "--overwrite")], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and "step 1/" not in (tmp_path / "again.err").read_text():
        time.sleep(0.05)
    proc.send_signal(signal.SIGSTOP)  # between steps, deterministically
    text = (tmp_path / "again.err").read_text()
    assert re.findall(r"step (\d+)/", text)[:1] == ["1"] and "Resuming" not in text, text[-3000:]
    assert not (out / ".saving" / "0").exists()  # the killed run's save went with --overwrite
    for f in hs.glob("hs_*.safetensors"):
        f.unlink()
    proc.send_signal(signal.SIGCONT)
    line = ended_with_one_line(proc, err, tmp_path / "again.err")
    assert "--hidden-states" in line and "samples are bad" in line and "missing" in line, line
    assert not (out / "manifest.json").exists()
