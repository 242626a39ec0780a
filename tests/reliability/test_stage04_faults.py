"""Stage 04 under faults: SIGKILL or SIGTERM mid-training, then the same command resumes from the last checkpoint
with the step count continuing; a corrupt, truncated or foreign hidden-state file is named before training starts."""
import json
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_script, train_args
from test_cli_prepare_vocab import assert_refused


@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_signal_during_training_then_resume(stages, model_path, tmp_path, sig):
    """SIGKILL loses the steps since the last checkpoint; SIGTERM lets speculators save an `interrupted` one. Either
    way the same command resumes with the step count continuing, never from step 1."""
    out = tmp_path / "draft"
    argv = train_args(model_path, stages, out, "--epochs", "3", "--checkpoint-freq", "0.5")
    err = open(tmp_path / "first.err", "w")  # a file, not a pipe: a full pipe would stall the child
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
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


def test_corrupt_hidden_states_are_named_before_training(stages, model_path, tmp_path):
    hs = tmp_path / "hs"
    shutil.copytree(stages["hs"], hs)
    f = hs / "hs_5.safetensors"
    data = bytearray(f.read_bytes())
    data[-7] ^= 0x20
    f.write_bytes(bytes(data))
    d = dict(stages, hs=hs)
    assert_refused(*run_script(*train_args(model_path, d, tmp_path / "ck")), "hs_5.safetensors", "checksum mismatch",
                   "rerun 02_extract_hidden_states.py")
    f.write_bytes(bytes(data[:-100]))  # truncated: caught by the header check, without reading the data
    assert_refused(*run_script(*train_args(model_path, d, tmp_path / "ck")), "hs_5.safetensors", "truncated")
    import torch
    from safetensors.torch import save_file
    save_file({"weight": torch.zeros(3)}, str(f))  # a valid safetensors file, but not ours
    assert_refused(*run_script(*train_args(model_path, d, tmp_path / "ck")), "hs_5.safetensors", "missing tensors")
    assert not (tmp_path / "ck").exists()
