"""scripts/setup.sh on a Python that already holds the stack, without the network (about a minute: it builds a venv
and imports the stack from it; its refusal of what it cannot have is in the default set,
tests/reliability/test_scripts.py)."""
import os
import shutil
import subprocess

from conftest import REPO, offline_env, setup_checkout


def test_setup_builds_on_an_installed_stack_without_the_network(tmp_path):
    """A Python that already holds the stack (here the test's own environment, as a GPU image holds torch with CUDA
    and transformers): setup builds .venv on it, installs nothing, and the stages' imports work from .venv; a
    second run is a stamp check."""
    root = setup_checkout(tmp_path)
    shutil.copytree(os.path.join(REPO, "eagle3pipe"), root / "eagle3pipe",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, "requirements.txt"), root)
    models = root / "data" / "models"
    models.mkdir(parents=True)  # the conversion's own stamp: this copy is the converted model (linked, not copied)
    subprocess.run(["cp", "-al", os.path.join(REPO, "data", "models", "smollm2-135m-instruct"), str(models)],
                   check=True)
    (tmp_path / "wheels").mkdir()
    env = {**offline_env(tmp_path / "wheels"), "EAGLE3_BASE_PYTHON": os.path.join(REPO, ".venv", "bin", "python")}
    p = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "it holds everything the stack needs" in p.stdout and "installed the cpu stack" in p.stdout, p.stdout
    py = root / ".venv" / "bin" / "python"
    q = subprocess.run([str(py), "-c", "import torch, transformers, speculators, sys; print(sys.prefix)"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert q.returncode == 0 and q.stdout.strip() == str(root / ".venv"), q.stderr
    p = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "cpu stack already installed" in p.stdout, p.stdout + p.stderr
