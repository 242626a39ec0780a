"""Stage 04's resume against a checkpoint damaged after the run, through two real trainings (the default set proves
the same check on a folder the stage made, without training: tests/unit/test_rules.py)."""
from conftest import assert_refused, run_script, train_args


def test_a_checkpoint_missing_a_file_it_wrote_is_named_before_speculators_resumes_from_it(stages, model_path, tmp_path):
    """A checkpoint's weights deleted after the run: the rerun names the missing file and the checkpoint in one line
    before anything loads (speculators would fail on it after loading the model and data); with that checkpoint moved
    away, the same command trains again."""
    out = tmp_path / "draft"
    p, _ = run_script(*train_args(model_path, stages, out, "--epochs", "1"))
    assert p.returncode == 0, p.stderr[-2000:]
    (out / "0" / "model.safetensors").unlink()
    assert_refused(*run_script(*train_args(model_path, stages, out, "--epochs", "1")),
                   "0/model.safetensors is gone (deleted since this stage wrote it)", "move 0 away")
    (out / "0").rename(tmp_path / "0.moved")
    p, _ = run_script(*train_args(model_path, stages, out, "--epochs", "1"))
    assert p.returncode == 0 and (out / "0" / "model.safetensors").exists(), p.stderr[-2000:]
