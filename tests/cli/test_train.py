"""Stage 04 through its command line: cross-stage refusals before anything heavy."""
import shutil
import subprocess

import pytest

from conftest import assert_refused, run_script, train_args


def test_cross_stage_refusals(stages, model_path, tmp_path):
    other = tmp_path / "prep2"
    p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "5", "--max-seq-len", "512",
                      "--output-dir", str(other))
    assert p.returncode == 0
    bad_hs = tmp_path / "hs_bad"
    shutil.copytree(stages["hs"], bad_hs)
    f = bad_hs / "hs_3.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    bad_vocab = tmp_path / "vocab_bad"
    shutil.copytree(stages["vocab"], bad_vocab)
    import numpy as np
    np.save(bad_vocab / "d2t.npy", np.zeros(100, dtype=np.int64))
    swapped = tmp_path / "vocab_swapped"  # another well-formed mapping of the same size put in place of stage 03's
    shutil.copytree(stages["vocab"], swapped)
    t2d = np.roll(np.load(swapped / "t2d.npy"), 1)
    np.save(swapped / "t2d.npy", t2d)
    np.save(swapped / "d2t.npy", (np.flatnonzero(t2d) - np.arange(int(t2d.sum()))).astype(np.int64))
    out = tmp_path / "out"
    cases = [
        (["--hidden-states", str(tmp_path / "none")], ["--hidden-states", "run 02_extract_hidden_states.py first"]),
        (["--prepared-data", str(other)], ["extracted from another stage 01 run", "rerun 02_extract_hidden_states.py"]),
        (["--hidden-states", str(bad_hs)], ["hs_3.safetensors", "truncated", "rerun 02_extract_hidden_states.py"]),
        (["--vocab-mapping", str(bad_vocab)], ["d2t [100]", "rerun 03_build_vocab_mapping.py"]),
        (["--vocab-mapping", str(swapped)], ["d2t.npy changed since stage 03 wrote it", "rerun 03_build_vocab_mapping.py"]),
        (["--vocab-mapping", str(stages["prepared"])], ["is the output of stage 'prepare'"]),
        (["--total-seq-len", "100"], ["--total-seq-len 100", "longest row"]),
        (["--lr", "5"], ["--lr 5"]),
        (["--layer-ids", "3,15,27"], ["--layer-ids [3, 15, 27]", "stage 02 extracted [2, 15, 27]"]),
        (["--engine-gpus", "0"], ["--engine-gpus", "only with --online"]),
        (["--hidden-state", "x"], ["unknown flag --hidden-state", "did you mean --hidden-states"]),
    ]
    for extra, needles in cases:
        argv = train_args(model_path, stages, out)
        p, secs = run_script(*argv, *extra)
        assert_refused(p, secs, *needles)
    assert not out.exists()


def _no_gpu():
    from eagle3pipe.base.devices import visible_gpus
    return not visible_gpus()


# every numeric flag and the device against this machine, the data and the memory: one line each, before anything
# heavy is imported and before --output-dir is made
PREFLIGHT = [
    (["--device", "cuda"], ["--device cuda: no GPU visible here"]),
    (["--device", "cpu", "--loss-implementation", "fused"], ["--loss-implementation fused", "needs a GPU"]),
    # speculators' own check named its own flag, exit 1, after the data was bridged into the folder
    (["--fsdp"], ["--fsdp: shards the draft across the ranks of a torchrun launch", "not started by torchrun"]),
    (["--total-seq-len", str(10**12)], [f"--total-seq-len {10**12}: one step needs at least", "use at most"]),
    (["--ttt-steps", "100000"], ["--ttt-steps 100000: at most 16", "acceptance decays"]),
    (["--epochs", "100000"], ["--epochs 100000: at most 1000"]),
    (["--epochs", "3", "--checkpoint-freq", "1.5"], ["--checkpoint-freq 1.5", "whole number"]),
    (["--epochs", "3", "--checkpoint-freq", "2"], ["--checkpoint-freq 2 with --epochs 3", "last epoch would not be saved"]),
    (["--checkpoint-freq", "0.001"], ["--checkpoint-freq 0.001: at least 0.01"]),
    (["--warmup-steps", "100000"], ["--warmup-steps 100000", "never reach --lr"]),
    (["--num-workers", "100000"], ["--num-workers 100000", "CPU cores"]),
    (["--num-samples", "999"], ["--num-samples 999: --prepared-data", "holds 24 rows"]),
]


@pytest.mark.parametrize("extra,needles", PREFLIGHT, ids=[" ".join(c[0])[:40] for c in PREFLIGHT])
def test_preflight_refuses_what_would_fail_after_the_model_loaded(stages, model_path, tmp_path, extra, needles):
    if extra[:2] == ["--device", "cuda"] and not _no_gpu():
        pytest.skip("a GPU is visible here")
    out = tmp_path / "out"
    assert_refused(*run_script(*train_args(model_path, stages, out, *extra)), *needles)
    assert not out.exists()


def test_disk_preflight_counts_the_checkpoints_it_keeps(stages, model_path, tmp_path):
    """Ten epochs keep ten checkpoints of about 0.08 GB (the SmolLM2 draft and its optimizer state), the one being
    saved and an `interrupted` one: refused on a 64 MB filesystem before anything is written."""
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        line = assert_refused(*run_script(*train_args(model_path, stages, disk / "out", "--epochs", "10")),
                              f"--output-dir {disk / 'out'}: needs about", "12 checkpoints of", "free")
        assert not (disk / "out").exists(), line
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


PROBE = """
import os, runpy, sys
sys.path.insert(0, {repo!r})
from eagle3pipe.train import train_plan
def confirm_device(*args):
    print("compile cache setting:", os.environ.get("TORCHINDUCTOR_CACHE_DIR"), flush=True)
    raise SystemExit(0)
train_plan.confirm_device = confirm_device  # observed, not replaced: the run stops there
sys.argv = {argv!r}
runpy.run_path("04_train.py", run_name="__main__")
"""


def test_the_compile_cache_setting_reaches_its_choice_as_the_user_left_it(stages, model_path, tmp_path, monkeypatch):
    """On a GPU, train_plan.confirm_device points torch.compile's cache at the user's folder (compile_cache.py).
    Importing torch._dynamo writes torch's own default, in /tmp, into that setting, where it would read as the
    user's choice (as it did on a lent H200). The verifier's weights check imports transformers' models, and with
    them torch._dynamo: it leaves the setting as it found it, so the choice sees what the user set (here nothing)."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    from conftest import REPO
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.format(repo=REPO, argv=train_args(model_path, stages, tmp_path / "out")))
    p, _ = run_script(str(probe))
    assert p.returncode == 0 and "compile cache setting: None" in p.stdout, p.stdout + p.stderr[-2000:]
