"""Stage 04 --online on the embedded default, in the default set: an external engine that extracts other layers is
refused before training. The end-to-end runs (an HF or vLLM engine, a SIGKILL mid-run and the same command resuming,
a poisoned sample skipped and counted, no file left beyond the cache budget, the engine and loader workers gone with
the killed run; the engine dying mid-run) are in slow/test_faults.py and slow/test_online_engine.py, to keep the
default set within 15 minutes."""
import os
import socket
import subprocess
import sys
import time

from conftest import REPO, online_args, run_script

def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_external_engine_with_other_layers_is_refused_before_training(small, model_path, tmp_path):
    """An engine at --engine-address that stores other layers than this run needs: one line after its first answer,
    before any training (and the engine, not ours, keeps running)."""
    port = closed_port()
    log = open(tmp_path / "engine.log", "w")
    engine = subprocess.Popen([sys.executable, "-m", "eagle3pipe.engines.hf_server", "--model-path", model_path, "--layer-ids",
                               "2,15,30", "--spool", str(tmp_path / "spool"), "--port", str(port)], cwd=REPO,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while "serving" not in (tmp_path / "engine.log").read_text() and time.time() < deadline:
            assert engine.poll() is None, (tmp_path / "engine.log").read_text()
            time.sleep(0.5)
        p, _ = run_script(*online_args(model_path, small, tmp_path / "ck", "--engine-address", f"127.0.0.1:{port}",
                                      "--engine-spool", str(tmp_path / "spool")))
        errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
        assert p.returncode == 1 and len(errors) == 1, p.stderr[-3000:]
        assert "stores hidden states of shape [16, 3, 576]" in errors[0] and "[16, 4, 576]" in errors[0]
        assert "step " not in p.stderr and engine.poll() is None
        assert os.listdir(tmp_path / "spool") == []  # the probe's file was read and deleted
    finally:
        engine.kill()
        log.close()
