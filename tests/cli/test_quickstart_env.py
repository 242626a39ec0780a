"""The quickstart's numbers: BUDGET_MIN, NUM_SAMPLES, EPOCHS, NUM_PROMPTS that are not what they must be (nan, inf,
negative, zero, a word, a fraction for a count) are refused in one line before anything runs, by
scripts/quickstart.sh and by the estimate it calls (`python -m eagle3pipe.estimate`), never a run of another size."""
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
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(REPO, "scripts", "quickstart.sh"), tmp_path / "scripts")
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
    p, secs = run_script("-m", "eagle3pipe.estimate", *[x for kv in argv.items() for x in kv])
    assert_refused(p, secs, flag, repr(value))
