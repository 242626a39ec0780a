"""Stage 04 on a hostile folder (tests/hostile.py): a finished run's every made name linked out, a person's hard link
to its run.yaml, a link where the next checkpoint is staged, --overwrite over a person's notes. About 50 s (four
trainings); the default set keeps stages 01, 02 and 03 on hostile folders (tests/reliability/test_hostile.py) and
the ownership rules themselves (tests/reliability/test_ownership.py, test_trust.py)."""
import os
import shutil

from conftest import run_script
from hostile import hostile, one_line_or_success, sentinel, tree_sum


def test_stage04_on_a_hostile_folder(model_path, stages, trained, tmp_path):
    from conftest import TRAINED_EPOCHS, train_args
    argv = lambda out: train_args(model_path, stages, out, "--epochs", str(TRAINED_EPOCHS), "--lr", "3e-3")  # noqa: E731
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained[0], ckpt, symlinks=True)
    # a finished run: a rerun trains nothing and refuses nothing. One made name of each kind gets a link.
    kinds = ("manifest.json", ".eagle3.lock", ".eagle3-owner.jsonl", "last", "logs", "logs/metrics.jsonl", "1",
             "1/model.safetensors", ".bridge", "checkpoint_best")
    hostile(argv, ckpt, tmp_path / "h04", pick=lambda n: n in kinds, overwrite=False)
    # a person's hard link to the stage's run.yaml: speculators rewrites it every run; the person's copy stays
    keep = tmp_path / "run_keep.yaml"
    os.link(ckpt / "run.yaml", keep)
    text = keep.read_text()
    p, _ = run_script(*argv(ckpt))
    assert p.returncode == 0 and keep.read_text() == text, p.stderr[-2000:]
    # a link planted where the next checkpoint will be staged (a name the stage has not made yet): refused, not
    # written through
    s = sentinel(tmp_path / "next")
    before = tree_sum(s)
    work = tmp_path / "next" / "work"
    shutil.copytree(ckpt, work, symlinks=True)
    nxt = str(TRAINED_EPOCHS)  # the epoch a longer run saves next
    os.symlink(s / "dir", work / ".saving" / nxt, target_is_directory=True)
    p, _ = run_script(*train_args(model_path, stages, work, "--epochs", str(TRAINED_EPOCHS + 1), "--lr", "3e-3"))
    assert p.returncode != 0 and f".saving/{nxt}" in one_line_or_success(p, f"link at .saving/{nxt}"), p.stderr[-2000:]
    assert tree_sum(s) == before
    # --overwrite with a person's notes in logs/ and in an epoch folder, which the stage would have to remake:
    # refused before anything is deleted, naming the note; every checkpoint and note stays
    (ckpt / "logs" / "notes.txt").write_text("a person's notes\n")
    (ckpt / "0" / "notes.txt").write_text("a person's notes\n")
    before = tree_sum(ckpt)
    p, _ = run_script(*argv(ckpt), "--overwrite")
    line = one_line_or_success(p, "--overwrite with notes")
    assert p.returncode == 2 and "inside a folder this stage made" in line and "nothing was deleted" in line, line
    assert tree_sum(ckpt) == before and (ckpt / "1" / "model.safetensors").exists()
