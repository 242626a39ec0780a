"""Fault scenarios run by two tiers with different points: reliability/ (the default set) and slow/ (the rest)."""
import json
import os
import re
import signal

from conftest import rows_of, run_script, train_args
from eagle3pipe.hidden_states import check_file, hs_path


def cmd(model_path, prep, out, *extra):
    return ["02_extract_hidden_states.py", "--backend", "hf", "--model-path", model_path, "--prepared-data",
            str(prep), "--output-dir", str(out), "--max-seq-len", "512", "--batch-size", "2", *extra]


def assert_complete(prep, out, n_states=4, hidden=576):
    rows = [r["input_ids"] for r in rows_of(prep)]
    names = sorted(os.listdir(out))
    assert not [n for n in names if ".tmp-" in n], names  # no temporary file left behind
    assert len([n for n in names if n.startswith("hs_")]) == len(rows)  # one file per row, nothing else
    for i, r in enumerate(rows):
        assert check_file(hs_path(out, i), r, n_states, hidden) is None, i
    m = json.load(open(os.path.join(out, "manifest.json")))
    assert m["complete"] and m["counts"]["ok"] == len(rows) and m["counts"]["failed"] == 0
    assert m["counts"]["resumed"] + m["counts"]["extracted"] == len(rows)
    return m


def stage02_killed_at(point, stages, model_path, tmp_path):
    """SIGKILL at a named point of stage 02 (eagle3pipe/faults.py), then the same command completes, keeping what
    the killed run finished."""
    out = tmp_path / "hs"
    n_hit = "2" if point in ("batch", "write", "between") else "1"  # mid-run, not on the first batch
    p, _ = run_script(*cmd(model_path, stages["prepared"], out),
                      env=dict(os.environ, EAGLE3_INJECT_KILL=f"{point}:{n_hit}"))
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])
    assert not (out / "manifest.json").exists()
    before = {n for n in os.listdir(out) if n.startswith("hs_")}
    if point == "write":
        assert any(".tmp-" in n for n in os.listdir(out))  # the half-written file never got its final name
    if point == "end":
        assert len(before) == len(rows_of(stages["prepared"]))
    p, _ = run_script(*cmd(model_path, stages["prepared"], out))
    assert p.returncode == 0, p.stderr[-2000:]
    m = assert_complete(stages["prepared"], out)
    assert m["counts"]["resumed"] == len(before)  # what the killed run finished is kept, not redone


def stage04_killed_in_save(point, stages, model_path, tmp_path):
    """SIGKILL with the second checkpoint half written (`save`), or with the previous copy deleted and the new one
    not yet renamed into place (`publish`): the rerun finds the last whole checkpoint and goes on from it."""
    out = tmp_path / "draft"
    # mid-epoch checkpoints too: the end of an epoch then replaces its mid-epoch checkpoint (the `publish` window)
    argv = train_args(model_path, stages, out, "--epochs", "3", "--checkpoint-freq", "0.5", "--total-seq-len", "512")
    p, _ = run_script(*argv, env={"EAGLE3_INJECT_KILL": point})
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    p, _ = run_script(*argv)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Resuming" in p.stderr and "Starting fresh" not in p.stderr, p.stderr[-3000:]
    assert json.load(open(out / "manifest.json"))["steps"] == int(re.findall(r"step \d+/(\d+)", p.stderr)[0])
    assert os.listdir(out / ".saving") == [] and os.path.realpath(out / "last") == str(out / "2")
