"""The quickstart's numbers: BUDGET_MIN, NUM_SAMPLES, EPOCHS, NUM_PROMPTS that are not what they must be (nan, inf,
negative, zero, a word, a fraction for a count) are refused in one line before anything runs, by
scripts/quickstart.sh and by the estimate it calls (`python -m eagle3pipe.evaluate.estimate`), never a run of another size."""
import os
import shutil
import subprocess

import pytest

from conftest import REPO, assert_refused, run_script

BAD_ENV = [("BUDGET_MIN", "nan"), ("BUDGET_MIN", "inf"), ("BUDGET_MIN", "-5"), ("BUDGET_MIN", "0"),
           ("BUDGET_MIN", "soon"), ("NUM_SAMPLES", "0"), ("NUM_SAMPLES", "lots"), ("EPOCHS", "-1"),
           ("NUM_PROMPTS", "1.5")]


@pytest.mark.parametrize("name,value", BAD_ENV)
def test_quickstart_refuses_a_bad_number_before_anything_runs(name, value, tmp_path):
    # the script alone in an empty checkout: past its checks it would stop at the missing setup.sh (127), never 2
    _checkout(tmp_path, "quickstart.sh", "lib.sh")
    p = subprocess.run(["bash", "scripts/quickstart.sh"], cwd=tmp_path, env={**os.environ, name: value},
                       capture_output=True, text=True, timeout=30)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {name}={value}:"), p.stderr
    assert not p.stdout and sorted(os.listdir(tmp_path)) == ["scripts"]


@pytest.mark.parametrize("flag,value", [("--budget-min", "nan"), ("--budget-min", "inf"), ("--budget-min", "-1"),
                                        ("--budget-min", "x"), ("--samples", "0"), ("--epochs", "two"),
                                        ("--num-prompts", "-3"), ("--batch-sizes", "1,0")])
def test_the_estimate_refuses_a_bad_number_in_one_line(flag, value, tmp_path):
    argv = {"--model-path": "data/models/smollm2-135m-instruct", "--prepared-data": str(tmp_path), "--samples": "300",
            flag: value}
    p, secs = run_script("-m", "eagle3pipe.evaluate.estimate", *[x for kv in argv.items() for x in kv])
    assert_refused(p, secs, flag, repr(value))


def _checkout(tmp_path, *scripts):
    """The scripts alone in an empty checkout: past what a test checks they would stop at a missing file, never
    install or run anything."""
    (tmp_path / "scripts").mkdir(parents=True)
    for name in scripts:
        shutil.copy(os.path.join(REPO, "scripts", name), tmp_path / "scripts")
    return tmp_path


def _nvidia_smi(tmp_path, gpu):
    """A machine with or without an NVIDIA GPU, as nvidia-smi tells it (the only thing the scripts ask): gpu is None
    (no GPU), or each GPU's memory in MiB as `--query-gpu=memory.total` prints it ('' where that query fails)."""
    bin_ = tmp_path / ("gpu-bin" if gpu is not None else "cpu-bin")
    bin_.mkdir()
    script = "#!/bin/sh\nexit 9\n"
    if gpu is not None:
        memory = f"printf '{gpu}\\n'; exit 0" if gpu else "exit 9"
        script = (f"#!/bin/sh\ncase \"$*\" in *memory.total*) {memory};; esac\n"
                  "echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    (bin_ / "nvidia-smi").write_text(script)
    (bin_ / "nvidia-smi").chmod(0o755)
    return f"{bin_}:{os.environ['PATH']}"


H200, RTX4090 = "143771", "24564"


@pytest.mark.parametrize("gpu,env,says", [
    # the GPU recipe's own epochs and step: the best measured where the memory holds it, else the smaller
    (H200, {}, "(143771 MiB): training on all but the last 1,000 of the package ShareGPT conversations (the last "
               "1,000 kept for the evaluation), 8 epochs, a two-layer draft with a 32,768-token vocabulary, 32,768 "
               "tokens a step"),
    (f"{H200}\\n{RTX4090}", {}, "(24564 MiB: under the 40 GB for 32,768 tokens a step): training on all but the "
                                "last 1,000 of the package ShareGPT conversations (the last 1,000 kept for the "
                                "evaluation), 3 epochs, a two-layer draft with a 32,768-token vocabulary, 8,192 "
                                "tokens a step"),  # the smallest GPU decides
    ("", {}, "(its memory unread: under the 40 GB for 32,768 tokens a step): training on all but the last 1,000 of "
             "the package ShareGPT conversations (the last 1,000 kept for the evaluation), 3 epochs"),
    (H200, {"EPOCHS": "5"}, ", 5 epochs, a two-layer draft"),                    # the user's, on a GPU
    (RTX4090, {"EPOCHS": "5"}, ", 5 epochs, a two-layer draft"),
    (H200, {"NUM_SAMPLES": "2000"}, "training on 2000 ShareGPT"),
    (None, {}, "up to 300 ShareGPT conversations (fewer where this CPU cannot run them in 24 minutes), 1 epoch(s)"),
    (None, {"EPOCHS": "2", "NUM_SAMPLES": "50"}, "50 ShareGPT conversations (exactly these, however long they take), 2"),
])
def test_the_dry_run_says_what_runs_on_this_machine_and_runs_nothing(gpu, env, says, tmp_path):
    # a GPU once trained 1 epoch, not the 3 the quickstart announced: the CPU's default leaked into the GPU's
    root = _checkout(tmp_path / "repo", "quickstart.sh", "lib.sh")
    p = subprocess.run(["bash", "scripts/quickstart.sh", "--dry-run"], cwd=root, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PATH": _nvidia_smi(tmp_path, gpu), **env})
    assert p.returncode == 0 and says in p.stdout and "--dry-run: nothing run" in p.stdout, p.stdout + p.stderr
    assert sorted(os.listdir(root)) == ["scripts"]


@pytest.mark.parametrize("argv,says", [(["--bogus"], "error: argument --bogus: expected nothing or --dry-run"),
                                       (["--dry-run", "x"], "error: arguments --dry-run\\ x: expected nothing")])
def test_quickstart_refuses_an_argument_it_does_not_take(argv, says, tmp_path):
    root = _checkout(tmp_path, "quickstart.sh", "lib.sh")
    p = subprocess.run(["bash", "scripts/quickstart.sh", *argv], cwd=root, capture_output=True, text=True, timeout=30)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(says), p.stderr


def test_a_value_with_a_newline_is_refused_in_one_line(tmp_path):
    root = _checkout(tmp_path, "quickstart.sh", "lib.sh")
    p = subprocess.run(["bash", "scripts/quickstart.sh"], cwd=root, capture_output=True, text=True, timeout=30,
                       env={**os.environ, "NUM_SAMPLES": "5\nerror: not from the script"})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and lines == ["error: NUM_SAMPLES=$'5\\nerror: not from the script': expected a whole "
                                           "number >= 1"], p.stderr
