"""A probe worker that dies (injected: EAGLE3_INJECT_KILL=worker-probe) keeps stage 04's data-loader workers off its
fork server (warm_start.WorkerServer): one warning line, the workers are spawned as speculators starts them, the
batches still come, and nothing outlives the process. (Workers forked once the probe answers:
tests/slow/test_worker_server.py and, through stage 04 itself, tests/reliability/test_lifeline.py.)"""
from conftest import left_behind
from worker_case import run_case


def test_a_probe_that_dies_means_spawned_workers_and_one_line(tmp_path):
    out, err, mark = run_case(tmp_path, fault="worker-probe")
    assert not out["forked"]
    lines = [line for line in err.splitlines() if "fork server is not used" in line]
    assert len(lines) == 1 and "probe worker died" in lines[0], err[-2000:]
    rows = [r for b in out["batches"] for r in b]
    assert [r[0] for r in rows] == [0, 1, 2, 3] and all(r[1] == out["me"] for r in rows)  # spawned: our children
    assert left_behind(mark) == []
