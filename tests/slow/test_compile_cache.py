"""A second run reuses what the first compiled: two processes each compile the same small function with
torch.compile on this CPU (inductor's C++ backend) after compile_cache.prepare(), sharing the user's cache folder;
the second finds the graph in the cache (torch's own counters), and a cache that is not the user's alone is never
read (the second process then compiles again, into a folder of its own). The rules: tests/unit/test_compile_cache.py."""
import json
import os
import subprocess
import sys

from conftest import REPO

CHILD = """
import json, logging, sys
sys.path.insert(0, {repo!r})
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from eagle3pipe.base import compile_cache
path, kept = compile_cache.prepare()
import torch
from torch._dynamo.utils import counters
f = torch.compile(lambda x: torch.nn.functional.gelu(x @ x.T).sum(-1) * 3)
f(torch.randn(16, 8))
print(json.dumps({{"path": path, "kept": kept, "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "miss": counters["inductor"]["fxgraph_cache_miss"]}}))
"""


def _run(home):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    p = subprocess.run([sys.executable, "-c", CHILD.format(repo=REPO)], capture_output=True, text=True, timeout=600,
                       env={**env, "XDG_CACHE_HOME": str(home)})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def test_a_second_run_reuses_the_compiled_graph_and_a_foreign_cache_is_never_read(tmp_path):
    first, _ = _run(tmp_path / "cache")
    assert first["kept"] and first["miss"] >= 1 and first["hit"] == 0, first
    second, _ = _run(tmp_path / "cache")
    assert second["path"] == first["path"] and second["hit"] >= 1 and second["miss"] == 0, second
    os.chmod(first["path"], 0o777)  # now anyone could have planted what it holds
    third, err = _run(tmp_path / "cache")
    assert not third["kept"] and third["path"] != first["path"] and third["hit"] == 0 and third["miss"] >= 1, third
    assert err.count("not trusted, never read") == 1, err[-2000:]
    assert not os.path.exists(third["path"])  # the run's own folder went with it
