"""Stage 04's data-loader workers fork from its warm server (warm_start.WorkerServer) once a probe worker forked from
it has answered: through speculators' own loader, each worker is the server's child and hands batches back, and
nothing outlives the process. (The default set proves the same through stage 04 itself: a step trained on forked
workers' batches, tests/reliability/test_lifeline.py; the fallback: tests/reliability/test_worker_server.py.)"""
from conftest import left_behind
from worker_case import run_case


def test_workers_fork_from_the_server_once_its_probe_answers(tmp_path):
    out, err, mark = run_case(tmp_path)
    assert out["forked"] and "not used" not in err, err[-2000:]
    rows = [r for b in out["batches"] for r in b]
    assert [r[0] for r in rows] == [0, 1, 2, 3]
    assert all(r[1] != out["me"] for r in rows)  # each worker is the server's child, not the stage's
    assert left_behind(mark) == []
