"""Stage 01's worker processes (--num-workers, eagle3pipe/chat/tokenize_workers.py) end with the stage however either
ends: a worker killed is one line and no folder, not a wait on results that never come; a stop signal or a SIGKILL
of the stage leaves no worker behind. Real workers, faults injected (eagle3pipe/base/faults.py)."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from conftest import REPO, left_behind, marked_processes, model_with_template


def _as_from_a_terminal():
    # a process that inherits a signal ignored (a background job's INT, nohup's HUP) keeps it ignored, and these
    # tests may themselves run as one
    for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)


def _stage01(model_path, out, fault, *argv):
    mark = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EAGLE3_TEST_MARK": mark, "EAGLE3_LIFELINE_GRACE": "1", **fault}
    p = subprocess.run([sys.executable, "01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "60",
                        "--max-seq-len", "256", "--num-workers", "2", "--output-dir", str(out), *argv],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env=env, preexec_fn=_as_from_a_terminal)
    return p, mark


def test_a_worker_that_dies_ends_the_stage_in_one_line_with_nothing_written(model_path, tmp_path):
    p, mark = _stage01(model_path, tmp_path / "out", {"EAGLE3_INJECT_KILL": "tokenize-worker"})
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 1 and len(lines) == 1 and "a tokenizing worker process died" in lines[0] \
        and "--num-workers" in lines[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr and not (tmp_path / "out").exists()
    assert left_behind(mark) == []


@pytest.mark.parametrize("fault,code", [({"EAGLE3_INJECT_SIGNAL": "tokenize:TERM:10"}, 143),
                                        ({"EAGLE3_INJECT_SIGNAL": "tokenize-start:TERM"}, 143),
                                        pytest.param({"EAGLE3_INJECT_SIGNAL": "tokenize:INT:10"}, 130,
                                                     marks=pytest.mark.slow),
                                        ({"EAGLE3_INJECT_KILL": "tokenize:10"}, -9)])
def test_a_stage_stopped_or_killed_while_its_workers_tokenize_leaves_none_behind(model_path, tmp_path, fault, code):
    p, mark = _stage01(model_path, tmp_path / "out", fault)
    assert p.returncode == code, p.stderr[-2000:]
    if code > 0:
        lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "stopped by a signal" in lines[0] and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out").exists()
    assert left_behind(mark) == []


def test_a_template_that_loops_on_a_later_record_is_refused_there_and_the_workers_end(model_path, tmp_path):
    """A template that loops on some records: the refusal names the first of them, as one process names it, after
    one time budget (a worker returns its chunk at that record), and the workers busy with the chunks queued behind
    it end with the stage instead of finishing them (at a 10 s budget each, minutes)."""
    model = model_with_template(
        model_path, tmp_path / "model",
        "{% if 'LOOP' in messages[0]['content'] %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
        "{% endfor %}{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "messages": [
        {"role": "user", "content": f"{'LOOP' if i >= 7 else 'q'} {i}"}, {"role": "assistant", "content": "a"}]}) + "\n"
        for i in range(120)))
    p, mark = _stage01(str(model), tmp_path / "out", {"EAGLE3_TEMPLATE_TIMEOUT_S": "2"}, "--dataset", str(data))
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: record r7: ") \
        and "did not finish one render within 2 s" in lines[0], p.stderr[-2000:]
    assert not (tmp_path / "out").exists() and left_behind(mark) == []


@pytest.mark.parametrize("nth", [pytest.param("1", marks=pytest.mark.slow), "5"])
def test_a_render_stuck_in_one_c_call_is_killed_and_named(model_path, tmp_path, nth):
    """A Jinja expression that builds gigabytes runs in one C call, deaf to the render's alarm (3 GB took 7.5 s here,
    the alarm set for 1 s). The render runs in a worker the stage kills once the budget and its grace are past:
    one line naming the record, no folder, no worker left. The 1st render is the probe's (its own worker, before
    the folder is taken); the 5th is one of the two workers' in the stage's loop."""
    p, mark = _stage01(model_path, tmp_path / "out", {"EAGLE3_INJECT_DEAF": f"render:{nth}",
                                                       "EAGLE3_TEMPLATE_TIMEOUT_S": "1"})
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[0].startswith("error: record ") and "did not finish one render within 1 s" in lines[0], lines[0]
    if nth == "1":  # the probe's: the first record (ShareGPT's first conversation)
        assert lines[0].startswith("error: record QWJhYvA_0: "), lines[0]
    assert not (tmp_path / "out").exists() and left_behind(mark) == []


@pytest.mark.parametrize("workers", ["1", pytest.param("0", marks=pytest.mark.slow)])
def test_a_tokenizer_that_panics_is_one_line_naming_the_record(model_path, tmp_path, workers):
    """A pre-tokenizer regex that backtracks past Oniguruma's limit on one record: the tokenizers library panics
    (pyo3's PanicException, a BaseException, and a Rust report of 100 lines under RUST_BACKTRACE=1). One line naming
    the record and the tokenizer, exit 2, no folder; from a worker, not a line of Rust's report either."""
    with open(os.path.join(model_path, "chat_template.jinja")) as f:
        model = model_with_template(model_path, tmp_path / "model", f.read())
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated",
                             "invert": False}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "messages": [
        {"role": "user", "content": "a" * 5000 + "b" if i == 3 else f"q {i}"}, {"role": "assistant", "content": "x"}]})
        + "\n" for i in range(6)))
    p, mark = _stage01(str(model), tmp_path / "out", {"RUST_BACKTRACE": "1"}, "--dataset", str(data),
                       "--num-workers", workers)
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[0].startswith(f"error: record r3: the tokenizer of {model} panicked: ") \
        and "retry-limit-in-match" in lines[0], lines[0]
    if workers == "1":  # Rust writes its report itself; a worker holds it back
        assert "panicked at" not in p.stderr and "stack backtrace" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out").exists() and left_behind(mark) == []


@pytest.mark.slow  # 12 s; the default set keeps stage 02's launcher under nohup (e2e/test_extract.py)
def test_a_hang_up_under_nohup_stops_neither_the_stage_nor_its_workers(model_path, tmp_path):
    """`nohup` makes the stage ignore SIGHUP, so that closing the ssh session does not stop it; its workers must
    ignore it too (the terminal's hang-up reaches the whole process group), else the stage ends as if a worker had
    run out of memory."""
    mark, out = uuid.uuid4().hex, tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EAGLE3_TEST_MARK": mark}
    proc = subprocess.Popen(["nohup", sys.executable, "01_prepare_dataset.py", "--model-path", model_path,
                             "--num-samples", "1500", "--num-workers", "2", "--output-dir", str(out)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=_as_from_a_terminal)
    deadline = time.time() + 120
    while len([c for _, c in marked_processes(mark) if "01_prepare_dataset.py" in c]) < 3:  # the stage and 2 workers
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGHUP)  # the session's hang-up, to every process of the group
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 0, err[-2000:]
    assert json.load(open(out / "manifest.json"))["counts"]["records_read"] == 1500
    assert left_behind(mark) == []


@pytest.mark.slow  # 10 s; the default set keeps a worker stuck in a render killed by the stage's watch
def test_a_worker_that_never_answers_ends_the_stage_at_its_deadline(model_path, tmp_path):
    """A worker stopped (SIGSTOP), or stuck in a lock it inherited across the fork, never returns its chunk: the
    stage waits on it for EAGLE3_WORKER_TIMEOUT_S, then ends in one line with nothing written and no worker left."""
    mark, out = uuid.uuid4().hex, tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EAGLE3_TEST_MARK": mark, "EAGLE3_WORKER_TIMEOUT_S": "3"}
    proc = subprocess.Popen([sys.executable, "01_prepare_dataset.py", "--model-path", model_path, "--num-samples",
                             "1500", "--num-workers", "2", "--output-dir", str(out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=_as_from_a_terminal)
    deadline = time.time() + 120
    while len(stage := [p for p, c in marked_processes(mark) if "01_prepare_dataset.py" in c]) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.05)
    os.kill(next(p for p in stage if p != proc.pid), signal.SIGSTOP)  # a worker
    err = proc.communicate(timeout=300)[1]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1 and "a tokenizing worker returned nothing for 3 s" in lines[0], \
        err[-2000:]
    assert "Traceback" not in err and not out.exists() and left_behind(mark) == []
