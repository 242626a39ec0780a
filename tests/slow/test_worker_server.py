"""Stage 04's data-loader workers fork from its warm server (warm_start.WorkerServer) once a probe worker forked from
it has answered: through speculators' own loader, each worker is then the server's child and hands batches back; a
probe that dies (injected: EAGLE3_INJECT_KILL=worker-probe) means one warning line and spawned workers, as
speculators starts them, and the batches still come. Nothing outlives the process either way. (Stage 04 trained on
forked workers: tests/slow/test_shards.py, fp8; killed with them: tests/slow/test_no_orphans.py.)"""
from conftest import left_behind
from worker_case import run_case


def test_workers_fork_from_the_server_once_its_probe_answers(tmp_path):
    out, err, mark = run_case(tmp_path)
    assert out["forked"] and "not used" not in err, err[-2000:]
    rows = [r for b in out["batches"] for r in b]
    assert [r[0] for r in rows] == [0, 1, 2, 3]
    assert all(r[1] != out["me"] for r in rows)  # each worker is the server's child, not the stage's
    assert left_behind(mark) == []


def test_a_probe_that_dies_means_spawned_workers_and_one_line(tmp_path):
    out, err, mark = run_case(tmp_path, fault="worker-probe")
    assert not out["forked"]
    lines = [line for line in err.splitlines() if "fork server is not used" in line]
    assert len(lines) == 1 and "probe worker died" in lines[0], err[-2000:]
    rows = [r for b in out["batches"] for r in b]
    assert [r[0] for r in rows] == [0, 1, 2, 3] and all(r[1] == out["me"] for r in rows)  # spawned: our children
    assert left_behind(mark) == []
