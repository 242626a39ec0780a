"""Slow (not in CI; `bash scripts/test.sh -m slow`): stage 02 with the vLLM backend on 300 prepared ShareGPT
samples, SIGKILLed mid-run (after the model loaded, while files are being written), then rerun: every file
present and valid, none lost, speculators' loader reads them all.
And a vLLM engine process killed mid-run ends stage 02 with one line; a rerun completes."""
import json
import os
import signal
import subprocess
import sys
import time


from conftest import REPO, run_script


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


def test_a_killed_engine_process_ends_stage02_with_one_line_and_a_rerun_completes(prep, model_path, tmp_path):
    """The OOM killer or a kill -9 takes vLLM's engine core mid-run: vLLM's front end alone would wait for ever.
    Stage 02 says so in one line within seconds (exit 1) and the same command resumes."""
    out = tmp_path / "hs"
    cmd = ["02_extract_hidden_states.py", "--backend", "vllm", "--model-path", model_path, "--prepared-data",
           str(prep), "--output-dir", str(out), "--max-seq-len", "256", "--batch-size", "1", "--dtype", "float32"]
    err = open(tmp_path / "err", "w")
    proc = subprocess.Popen([sys.executable, *cmd], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not any(
            n.startswith("hs_") for n in (os.listdir(out) if out.exists() else [])):
        time.sleep(0.1)
    kids = []
    for task in os.listdir(f"/proc/{proc.pid}/task"):
        kids += [int(x) for x in open(f"/proc/{proc.pid}/task/{task}/children").read().split()]
    assert kids, "no engine process"
    t0 = time.time()
    for pid in kids:
        os.kill(pid, signal.SIGKILL)
    rc = proc.wait(timeout=120)
    err.close()
    text = (tmp_path / "err").read_text()
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert rc == 1 and len(lines) == 1 and "died while it was working" in lines[0], text[-3000:]
    assert time.time() - t0 < 30 and not (out / "manifest.json").exists()
    p, _ = run_script(*cmd)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.load(open(out / "manifest.json"))["complete"]
