"""Stage 04 --online: the HF extraction engine killed mid-run ends the run with one line, and its loader workers go
with it (slow: the rest of online mode is in tests/e2e/test_online.py)."""
import os
import re
import signal
import subprocess
import sys
import time

from conftest import REPO, online_args
from faults import children, pids_alive


def test_online_hf_engine_death_stops_the_run_with_one_line(small, model_path, tmp_path):
    out = tmp_path / "draft"
    argv = online_args(model_path, small, out, "--backend", "hf", "--epochs", "3")
    err = open(tmp_path / "err", "w")
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline, pid = time.time() + 300, None
    while time.time() < deadline and pid is None:
        m = re.search(r"extraction engine \(hf, pid (\d+)\) ready", (tmp_path / "err").read_text())
        pid = int(m.group(1)) if m else None
        time.sleep(0.5)
    assert pid, (tmp_path / "err").read_text()[-3000:]
    while time.time() < deadline and "step 1/" not in (tmp_path / "err").read_text():
        time.sleep(0.5)
    family = [c for c in children(proc.pid) if c != pid]  # the loader workers
    os.kill(pid, signal.SIGKILL)
    rc = proc.wait(120)
    err.close()
    text = (tmp_path / "err").read_text()
    assert rc == 1, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, text[-3000:]
    assert errors[0].startswith("error: the extraction engine exited with code -9") and "rerun the same command" in \
        errors[0]
    deadline = time.time() + 30
    while pids_alive(family) and time.time() < deadline:
        time.sleep(0.5)
    assert not pids_alive(family)
