"""scripts/extract.sh with REPLICAS=2 on CPU: one stage 02 replica per GPU group (here, two CPU replicas), each
with its own log and PID file, into one folder that ends with a manifest, under the launcher's rules: a second
launch while they run is refused naming them, and their logs and PID files are recorded as the launcher's (a later
launch takes them back). The default set runs the launcher with one replica (tests/e2e/test_extract.py) and its
refusals (tests/cli/test_launcher.py)."""
import json
import os
import subprocess
import time

from conftest import REPO


def test_extract_sh_starts_one_replica_per_gpu_group(prep, model_path, tmp_path):
    out = tmp_path / "hs"
    env = dict(os.environ, REPLICAS="2", CUDA_VISIBLE_DEVICES="0,1", PYTHON=os.sys.executable)
    argv = ["bash", "scripts/extract.sh", "--backend", "hf", "--model-path", model_path, "--prepared-data", str(prep),
            "--output-dir", str(out), "--max-seq-len", "256"]
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "replica 0/2 on GPUs 0" in p.stdout and "replica 1/2 on GPUs 1" in p.stdout, p.stdout
    pids = [int((out / f"extract.shard-{k}.pid").read_text()) for k in range(2)]
    again = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and f"in use by another run (PID {pids[0]} " in again.stderr, again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and "replica" not in again.stdout
    deadline = time.time() + 600
    while any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
              for pid in pids) and time.time() < deadline:
        time.sleep(1)
    assert json.load(open(out / "manifest.json"))["complete"]
    assert all((out / f".shard-{k}-of-2.json").exists() for k in range(2))
    assert [int((out / f"extract.shard-{k}.pid").read_text()) for k in range(2)] == pids  # the second launch wrote none
    p = subprocess.run(argv + ["--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "all checks passed" in p.stdout, p.stderr
    env["REPLICAS"] = "3"  # 3 replicas on 2 GPUs: refused before anything starts
    p = subprocess.run(["bash", "scripts/extract.sh", "--backend", "hf", "--model-path", model_path,
                        "--prepared-data", str(prep), "--output-dir", str(tmp_path / "x")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "REPLICAS=3" in p.stderr and not (tmp_path / "x").exists()
