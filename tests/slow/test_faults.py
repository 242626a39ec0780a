"""The fault cases too slow for the default set: stage 02 killed at five points (load, mid-batch, writing, between
batches, the end), a disk that fills mid-run, stage 01 rewritten under a running stage 02; stage 04 killed while a
checkpoint is written and with the old checkpoint deleted and the new one not yet in place, stopped by SIGKILL or
SIGTERM mid-training, bad hidden-state files named where read; stage 04 --online with an HF or a vLLM engine killed
and resumed."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, assert_refused, ended_with_one_line, rows_of, run_script, train_args
from eagle3pipe.formats.hidden_states import check_file, hs_path
from faults import assert_complete, cmd, online_killed_and_resumed, stage02_killed_at, stage04_killed_in_save


@pytest.mark.parametrize("point", ["load", "batch", "write", "between", "end"])
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


def test_a_stop_during_an_epochs_measure_saves_interrupted_and_the_rerun_validates_that_epoch_first(stages, model_path,
                                                                                                  tmp_path):
    """SIGTERM inside the first epoch's acceptance measure: the run stops with `interrupted` (it was taken for the
    measure's failure: checkpoint_best fell back to the trainer's estimate and the stop was lost). The rerun keeps
    that epoch's own checkpoint, validates and measures it before the next epoch (its validation had never run, so
    it could never be checkpoint_best), then trains on; the SIGKILL twin (a kill in the same window) is the same
    rerun."""
    out = tmp_path / "draft"
    argv = train_args(model_path, stages, out, "--epochs", "2", "--total-seq-len", "512", "--num-samples", "12",
                      "--measure-prompts", "2", "--measure-tokens", "8")
    p, _ = run_script(*argv, env={"EAGLE3_INJECT_SIGNAL": "measure:TERM"})
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, p.stderr[-3000:])
    assert "acceptance measure failed" not in p.stderr, p.stderr[-3000:]
    assert (out / "0" / "config.json").exists() and not (out / "0" / "val_metrics.json").exists()
    p, _ = run_script(*argv)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "epoch 0: validating it first" in p.stderr and "acceptance measure failed" not in p.stderr, p.stderr[-3000:]
    assert not (out / "interrupted").exists()
    for epoch in ("0", "1"):
        assert "acceptance_measure" in json.load(open(out / epoch / "val_metrics.json")), epoch
    assert os.path.realpath(out / "checkpoint_best") in (str(out / "0"), str(out / "1"))


def test_online_hf_kill_resume_cache_and_skipped_sample(small, model_path, tmp_path):
    online_killed_and_resumed("hf", small, model_path, tmp_path)


def test_online_vllm_kill_resume_cache_and_skipped_sample(small, model_path, tmp_path):
    online_killed_and_resumed("vllm", small, model_path, tmp_path, epochs=2)


def test_bad_hidden_states_are_named_where_read_and_stop_the_run_beyond_a_share(stages, model_path, tmp_path):
    """Each sample is checked where it is read (CRC, dtype, finite values): one bad file of 24 is skipped, named and
    counted; a second (all NaN, with a valid checksum) is more than the share and stops the run with one line.
    --verify-data names the first before step 1; a wrong dtype or a truncated file is named up front anyway."""
    import json
    import torch
    from eagle3pipe.formats.hidden_states import save
    from safetensors.torch import load_file
    hs = tmp_path / "hs"
    shutil.copytree(stages["hs"], hs)
    f = hs / "hs_5.safetensors"
    st = os.stat(f)
    data = bytearray(f.read_bytes())
    data[-7] ^= 0x20
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # a flipped bit: the file's own time
    d = dict(stages, hs=hs)
    assert_refused(*run_script(*train_args(model_path, d, tmp_path / "ck0", "--verify-data")), "hs_5.safetensors",
                   "checksum mismatch", "rerun 02_extract_hidden_states.py")
    p, _ = run_script(*train_args(model_path, d, tmp_path / "ck", "--epochs", "1"))  # every row read once
    assert p.returncode == 0, p.stderr[-3000:]
    assert "hs_5.safetensors: checksum mismatch: corrupt data; sample skipped" in p.stderr
    assert json.load(open(tmp_path / "ck" / "manifest.json"))["skipped_samples"] == 1
    t = load_file(hs / "hs_6.safetensors")
    save(str(hs / "hs_6.safetensors"), {**t, "hidden_states": torch.full_like(t["hidden_states"], float("nan"))})
    p, _ = run_script(*train_args(model_path, d, tmp_path / "ck2", "--epochs", "1"))
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 1 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "2 of 24 samples are bad" in lines[0] and "rerun 02_extract_hidden_states.py" in lines[0], lines
    save(str(hs / "hs_6.safetensors"), {**t, "hidden_states": t["hidden_states"].to(torch.int64)})
    assert_refused(*run_script(*train_args(model_path, d, tmp_path / "ck3")), "hs_6.safetensors", "stored as I64")
    f.write_bytes(bytes(data[:-100]))  # truncated: caught by the header check, without reading the data
    assert_refused(*run_script(*train_args(model_path, d, tmp_path / "ck3")), "hs_5.safetensors", "truncated")
    from safetensors.torch import save_file
    save_file({"weight": torch.zeros(3)}, str(f))  # a valid safetensors file, but not ours
    assert_refused(*run_script(*train_args(model_path, d, tmp_path / "ck3")), "hs_5.safetensors", "missing tensors")
    assert not (tmp_path / "ck3").exists()


def test_stage01_rewritten_under_a_running_stage02_stops_it_with_one_line(stages, model_path, tmp_path):
    """Stage 01 reruns into the folder stage 02 is reading: stage 02 stops with one line naming it (exit 1), before
    it writes a manifest over files of two inputs."""
    prep, out = tmp_path / "prepared", tmp_path / "hs"
    shutil.copytree(stages["prepared"], prep)
    err = open(tmp_path / "err", "w")
    proc = subprocess.Popen([sys.executable, *cmd(model_path, prep, out, "--batch-size", "1")], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.time() + 300
    while time.time() < deadline and not (out.exists() and any(n.startswith("hs_") for n in os.listdir(out))):
        time.sleep(0.05)
    proc.send_signal(signal.SIGSTOP)  # held while stage 01 rewrites its input
    try:
        p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "6", "--max-seq-len",
                          "512", "--output-dir", str(prep))
        assert p.returncode == 0, p.stderr[-2000:]
    finally:
        proc.send_signal(signal.SIGCONT)
    line = ended_with_one_line(proc, err, tmp_path / "err")
    assert f"--prepared-data {prep}: changed while this stage ran" in line, line
    assert not (out / "manifest.json").exists()



def test_full_disk_mid_run_is_one_line_and_a_rerun_with_space_completes(stages, model_path, small_disk):
    prep = stages["prepared"]
    need = sum(len(r["input_ids"]) for r in rows_of(prep)) * (4 * 576 * 2 + 8)
    disk = small_disk(int(need * 1.5) // 2**20 + 2)
    out = disk / "hs"
    proc = subprocess.Popen([sys.executable, *cmd(model_path, prep, out, "--batch-size", "1")], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (out.exists() and any(n.startswith("hs_") for n in os.listdir(out))):
        time.sleep(0.05)
    with open(disk / "ballast", "wb") as f:  # someone else fills the disk while the stage runs
        try:
            while True:
                f.write(b"\0" * 2**20)
        except OSError:
            pass
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr[-2000:]
    line = [l for l in stderr.splitlines() if l.startswith("error: ")]
    assert len(line) == 1 and f"--output-dir {out}: disk full" in line[0] and "GB more needed" in line[0], stderr
    assert not [n for n in os.listdir(out) if ".tmp-" in n]  # no partial file, under any name
    rows = [r["input_ids"] for r in rows_of(prep)]
    for n in os.listdir(out):  # whatever was written is complete
        if n.startswith("hs_"):
            i = int(n[3:-12])
            assert check_file(hs_path(out, i), rows[i], 4, 576) is None
    os.remove(disk / "ballast")
    p, _ = run_script(*cmd(model_path, prep, out))
    assert p.returncode == 0, p.stderr[-2000:]
    assert_complete(prep, out)


def test_running_out_of_memory_is_one_line_naming_the_flag_that_bounds_it(stages, model_path, tmp_path):
    """torch's CPU allocator refusing 32 GiB at the second training batch (this run trains on the CPU, so the RAM is
    what --total-seq-len fills): one line with what was asked, how to resume, and --total-seq-len with its value and
    its floor (the longest row), which starts over; exit 1, no traceback, no finished run left behind. A GPU's
    wording and advice: tests/unit/test_rules.py."""
    out = tmp_path / "draft"
    argv = train_args(model_path, stages, out, "--epochs", "1", "--total-seq-len", "1024", "--num-samples", "12")
    p, _ = run_script(*argv, env={"EAGLE3_INJECT_OOM_AT_BATCH": "2:cpu"})
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 1 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    rows = open(stages["prepared"] / "tokenized_data.jsonl").read().splitlines()[:12]  # --num-samples: the first 12
    longest = max(len(json.loads(r)["input_ids"]) for r in rows)
    assert lines[0] == ("error: out of memory (RAM: asked for 32.00 GiB); free memory, then rerun the same command to "
                        f"resume; or lower --total-seq-len (1,024 now; the longest row needs {longest:,}) and start "
                        "over with --overwrite or another --output-dir"), lines[0]
    assert "step 1/" in p.stderr and "step 2/" not in p.stderr and not (out / "manifest.json").exists()


def test_a_verifier_whose_states_are_never_finite_is_refused_not_run_to_the_end(model_path, tmp_path):
    """Its first layer's norm all +inf (a checkpoint gone bad, or a --dtype its values overflow): every row's states
    are inf or NaN. Each row alone is a failed row; the first eight together are the verifier's fault: one line naming
    --model-path, exit 2, no hidden-state file, instead of a run through every row that ends with all of them failed
    (found by a held-out probe)."""
    import torch
    from safetensors.torch import load_file, save_file
    from verifiers import dense
    model = dense(str(tmp_path / "model"), model_path, "LlamaConfig", layers=8)
    weights = load_file(os.path.join(model, "model.safetensors"))
    weights["model.layers.0.input_layernorm.weight"] = torch.full_like(weights["model.layers.0.input_layernorm.weight"],
                                                                       float("inf"))
    save_file(weights, os.path.join(model, "model.safetensors"), metadata={"format": "pt"})
    prep = tmp_path / "prep"
    p, _ = run_script("01_prepare_dataset.py", "--model-path", model, "--num-samples", "12", "--max-seq-len", "128",
                      "--output-dir", str(prep))
    assert p.returncode == 0, p.stderr[-2000:]
    out = tmp_path / "hs"
    p, _ = run_script(*cmd(model, prep, out, "--batch-size", "4"))
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[0].startswith(f"error: --model-path {model}: its hidden states are not finite on any of the first 8 "
                               f"rows"), lines[0]
    assert not any(n.startswith("hs_") for n in os.listdir(out)) and not (out / "manifest.json").exists()
