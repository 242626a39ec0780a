"""Slow (not in CI; `bash scripts/test.sh -m slow`): stage 02 with the vLLM backend on 300 prepared ShareGPT
samples, SIGKILLed mid-run (after the model loaded, while files are being written), then rerun: every file
present and valid, none lost, speculators' loader reads them all."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_script

pytestmark = pytest.mark.slow


def test_vllm_300_samples_killed_and_resumed(model_path, tmp_path):
    prep, out = tmp_path / "prepared", tmp_path / "hs"
    p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "300",
                      "--output-dir", str(prep))
    assert p.returncode == 0, p.stderr
    rows = [json.loads(l)["input_ids"] for l in open(prep / "tokenized_data.jsonl")]
    cmd = [sys.executable, "02_extract_hidden_states.py", "--model-path", model_path, "--prepared-data", str(prep),
           "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    count = lambda: len([n for n in os.listdir(out) if n.startswith("hs_")]) if out.exists() else 0  # noqa: E731
    while time.time() < deadline and count() < 60:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the engine's processes too, as a machine crash would
    proc.wait()
    before = count()
    assert 60 <= before < len(rows)
    p, _ = run_script(*cmd[1:], timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    man = json.load(open(out / "manifest.json"))
    assert man["counts"]["ok"] == len(rows) and man["counts"]["resumed"] >= before - 4
    from hs_connectors import FileTransfer
    from speculators.data_generation.offline import check_hidden_states
    ft = FileTransfer(out)
    for i, r in enumerate(rows):
        check_hidden_states(ft.get_cached(i), r)
    assert not [n for n in os.listdir(out) if n.startswith(".hs_")]
