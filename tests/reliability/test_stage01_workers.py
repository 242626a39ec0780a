"""Stage 01's worker processes (--num-workers, eagle3pipe/tokenize_workers.py) end with the stage however either
ends: a worker killed is one line and no folder, not a wait on results that never come; a stop signal or a SIGKILL
of the stage leaves no worker behind. Real workers, faults injected (eagle3pipe/faults.py)."""
import os
import subprocess
import sys
import uuid

import pytest

from conftest import REPO, left_behind


def _stage01(model_path, out, fault):
    mark = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EAGLE3_TEST_MARK": mark, "EAGLE3_LIFELINE_GRACE": "1", **fault}
    p = subprocess.run([sys.executable, "01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "60",
                        "--max-seq-len", "256", "--num-workers", "2", "--output-dir", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    return p, mark


def test_a_worker_that_dies_ends_the_stage_in_one_line_with_nothing_written(model_path, tmp_path):
    p, mark = _stage01(model_path, tmp_path / "out", {"EAGLE3_INJECT_KILL": "tokenize-worker"})
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 1 and len(lines) == 1 and "a tokenizing worker process died" in lines[0] \
        and "--num-workers" in lines[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr and not (tmp_path / "out").exists()
    assert left_behind(mark) == []


@pytest.mark.parametrize("fault,code", [({"EAGLE3_INJECT_SIGNAL": "tokenize:TERM:10"}, 143),
                                        ({"EAGLE3_INJECT_SIGNAL": "tokenize:INT:10"}, 130),
                                        ({"EAGLE3_INJECT_KILL": "tokenize:10"}, -9)])
def test_a_stage_stopped_or_killed_while_its_workers_tokenize_leaves_none_behind(model_path, tmp_path, fault, code):
    p, mark = _stage01(model_path, tmp_path / "out", fault)
    assert p.returncode == code, p.stderr[-2000:]
    if code > 0:
        lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "stopped by a signal" in lines[0] and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out").exists()
    assert left_behind(mark) == []
