"""A process that builds a data loader through speculators' own loader code as stage 04 does, with
warm_start.WorkerServer behind it (tests/reliability/test_worker_server.py, tests/slow/test_worker_server.py). Each
case runs in a process of its own: the fork server is one per process."""
import json
import os
import subprocess
import sys
import uuid

from conftest import REPO

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
    from eagle3pipe import adapters
    from eagle3pipe.base import lifeline
    from eagle3pipe.train import warm_start
    lifeline.start()
    server = warm_start.WorkerServer(modules=("torch",), deadline=120).start()
    import speculators.train.dataloader as sdl
    with adapters.loader_workers(server.context, warm_start.worker_init):
        loader = sdl.DataLoader(Rows(), batch_size=2, num_workers=1, multiprocessing_context="spawn",
                                worker_init_fn=sdl._worker_init_fn, persistent_workers=True)
        batches = [b.tolist() for b in loader]
    print(json.dumps({{"batches": batches, "me": os.getpid(), "forked": loader.multiprocessing_context.get_start_method() == "forkserver"}}))
"""


def run_case(tmp_path, fault=None):
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
