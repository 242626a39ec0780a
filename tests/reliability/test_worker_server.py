"""Stage 04's data-loader workers fork from a warm server (warm_start.WorkerServer) only once a probe worker forked
from it has answered: through speculators' own loader, the workers are then the server's children and hand batches
back; a probe that dies (injected: EAGLE3_INJECT_KILL=worker-probe) means one warning line and spawned workers, as
speculators starts them, and the batches still come. Nothing outlives the process either way. Each case runs in a
process of its own (the fork server is one per process)."""
import json
import os
import subprocess
import sys
import uuid

from conftest import REPO, left_behind

CASE = """
import json, logging, os, sys
sys.path.insert(0, {repo!r})
import torch


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([i, os.getppid()])


if __name__ == "__main__":  # a worker imports this file to find Rows
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from eagle3pipe import adapters, lifeline, warm_start
    lifeline.start()
    server = warm_start.WorkerServer(modules=("torch",), deadline=120).start()
    import speculators.train.dataloader as sdl
    with adapters.loader_workers(server.context, warm_start.worker_init):
        loader = sdl.DataLoader(Rows(), batch_size=2, num_workers=1, multiprocessing_context="spawn",
                                worker_init_fn=sdl._worker_init_fn, persistent_workers=True)
        batches = [b.tolist() for b in loader]
    print(json.dumps({{"batches": batches, "me": os.getpid(), "forked": loader.multiprocessing_context.get_start_method() == "forkserver"}}))
"""


def _case(tmp_path, fault=None):
    mark = uuid.uuid4().hex
    script = tmp_path / "case.py"
    script.write_text(CASE.format(repo=REPO))
    env = {**os.environ, "EAGLE3_TEST_MARK": mark, "EAGLE3_LIFELINE_GRACE": "1"}
    env.pop("EAGLE3_INJECT_KILL", None)
    if fault:
        env["EAGLE3_INJECT_KILL"] = fault
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr, mark


def test_workers_fork_from_the_server_once_its_probe_answers(tmp_path):
    out, err, mark = _case(tmp_path)
    assert out["forked"] and "not used" not in err, err[-2000:]
    rows = [r for b in out["batches"] for r in b]
    assert [r[0] for r in rows] == [0, 1, 2, 3]
    assert all(r[1] != out["me"] for r in rows)  # each worker is the server's child, not the stage's
    assert left_behind(mark) == []


def test_a_probe_that_dies_means_spawned_workers_and_one_line(tmp_path):
    out, err, mark = _case(tmp_path, fault="worker-probe")
    assert not out["forked"]
    lines = [line for line in err.splitlines() if "fork server is not used" in line]
    assert len(lines) == 1 and "probe worker died" in lines[0], err[-2000:]
    rows = [r for b in out["batches"] for r in b]
    assert [r[0] for r in rows] == [0, 1, 2, 3] and all(r[1] == out["me"] for r in rows)  # spawned: our children
    assert left_behind(mark) == []
