"""Every wait has a deadline: a hub that answers the reachability probe and then stalls, a chat template that loops,
an ownership record or a manifest far larger than any stage writes. Each ends in one line, exit 2, within seconds of
its limit, with nothing of the operator's touched."""
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, assert_refused, model_with_template, run_script, snapshot


class _Stalling(http.server.BaseHTTPRequestHandler):
    """Answers the pipeline's reachability probe at once; every other request gets no answer for a minute."""

    def do_HEAD(self):
        if self.path.startswith("/api/models"):
            self.send_response(200)
            self.end_headers()
            return
        self.server.stop.wait(60)

    do_GET = do_HEAD

    def log_message(self, *args):
        pass


@pytest.fixture
def stalling_hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stalling)
    server.daemon_threads = True
    server.stop = threading.Event()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.stop.set()
    server.shutdown()


def _hub_env(tmp_path, endpoint):
    return {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "EAGLE3_HUB_TIMEOUT_S": "2",
            "HF_HUB_OFFLINE": "0", "HTTPS_PROXY": "", "HTTP_PROXY": "", "NO_PROXY": "127.0.0.1"}


def test_a_hub_that_stalls_after_the_probe_is_one_line_within_its_deadline(stalling_hub, model_path, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                    + "\n")
    p, secs = run_script("01_prepare_dataset.py", "--model-path", "someorg/stalls", "--dataset", str(chat),
                         "--output-dir", str(tmp_path / "out"), env=_hub_env(tmp_path, stalling_hub), timeout=60)
    assert_refused(p, secs, "--model-path someorg/stalls: config.json from the hub: no answer within 2 s")
    assert secs < 30 and not (tmp_path / "out").exists()
    # a streamed hub dataset: the verifier is local, the dataset stalls
    p, secs = run_script("01_prepare_dataset.py", "--model-path", model_path, "--dataset", "someorg/stalling-data",
                         "--output-dir", str(tmp_path / "out2"), env=_hub_env(tmp_path, stalling_hub), timeout=60)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "--dataset someorg/stalling-data: no answer within 2 s" in lines[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr and secs < 30


@pytest.mark.slow  # 16 s; the default set keeps a template looping on a later record and a render deaf to its alarm
def test_a_template_that_loops_is_one_line_naming_it(model_path, tmp_path):  # (R/test_stage01_workers.py)
    """Two nested 99,999-step loops: 10^10 steps of Jinja. transformers runs it, so this refusal comes after the
    tokenizer loaded (no model ever does in stage 01); it must come within the budget, not after hours."""
    model = model_with_template(model_path, tmp_path / "model", "{% for i in range(99999) %}{% for j in range(99999) %}"
                                "{% endfor %}{% endfor %}{{ messages[0]['content'] }}")
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                    + "\n")
    t0 = time.time()
    p, secs = run_script("01_prepare_dataset.py", "--model-path", str(model), "--dataset", str(chat), "--output-dir",
                         str(tmp_path / "out"), env={"EAGLE3_TEMPLATE_TIMEOUT_S": "1"}, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"the chat template of {model} did not finish one render within 1 s" in lines[0], lines[0]
    assert time.time() - t0 < 60
    assert not (tmp_path / "out").exists()  # the template is tried on the first record before the folder is taken

    # SIGTERM in the middle of that render (a stage without a handler of its own): one line, 128 + 15
    env = {**os.environ, "EAGLE3_TEMPLATE_TIMEOUT_S": "120", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "01_prepare_dataset.py", "--model-path", str(model), "--dataset", str(chat),
                             "--output-dir", str(tmp_path / "out")], cwd=REPO, env=env, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(8)  # the tokenizer loads in a few seconds; then the render loops
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == ["error: stopped by a signal (SIGTERM); rerun the same command to resume"], err[-2000:]


def test_records_and_manifests_far_larger_than_a_stage_writes_are_refused_at_once(small, model_path, tmp_path):
    """An ownership record of 20 MB of valid lines in a folder of five files (reading 3 million lines took over a
    minute), and a 70 MB manifest: each one line, nothing touched."""
    vocab = tmp_path / "vocab"
    args = ("03_build_vocab_mapping.py", "--prepared-data", str(small["prepared"]), "--draft-vocab-size", "64",
            "--output-dir", str(vocab))
    p, _ = run_script(*args)
    assert p.returncode == 0, p.stderr[-2000:]
    record = vocab / ".eagle3-owner.jsonl"
    line = json.dumps(["f_0000000.npy", ["f", 1, 100, 1700000000123456789, 77, "ab" * 32]]) + "\n"
    with open(record, "a") as f:
        f.write(line * (20_000_000 // len(line)))
    before = snapshot(vocab)
    p, secs = run_script(*args)
    assert_refused(p, secs, ".eagle3-owner.jsonl: an oversized (", "ownership record")
    assert snapshot(vocab) == before

    prep = tmp_path / "prep"
    shutil.copytree(str(small["prepared"]), prep)
    with open(prep / "manifest.json", "w") as f:
        f.write('{"pad": "' + "x" * (70 << 20) + '"}')
    p, secs = run_script("03_build_vocab_mapping.py", "--prepared-data", str(prep), "--draft-vocab-size", "64",
                         "--output-dir", str(tmp_path / "vocab2"))
    assert_refused(p, secs, "manifest.json: 73,400,331 bytes; a file of this kind is at most")
    assert not (tmp_path / "vocab2").exists()
