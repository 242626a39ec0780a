"""Stage 04's preflight arithmetic and run identity (train_plan.py), and the input watch (input_watch.py), on real
settings records and real files."""
import json
import os

import pytest

from conftest import load_script
from eagle3pipe.base import compute
from eagle3pipe.storage import files, input_watch
from eagle3pipe.train import train_data, train_plan
from eagle3pipe.base.errors import RunError, UsageError

SMOL = {"hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}


def settings(*argv):
    return load_script("04_train.py").parse_args(["--model-path", "m", *argv])


def test_one_step_s_memory_is_checked_against_the_device():
    rows = [([1] * 512, [1] * 512)] * 24
    small = train_plan.Device([("H-tiny", 2 * 10**8)], on_gpu=True)
    with pytest.raises(UsageError, match=r"--total-seq-len 8192: one step needs at least 0\.3 GB .* more than the "
                                         r"H-tiny's 0\.2 GB; use at most [0-9,]+ \(the longest row needs 512\)"):
        train_plan.check_sizes(settings("--total-seq-len", "8192"), SMOL, rows, 4, 2048, small, "bfloat16")
    big = train_plan.Device([("H200", 141 * 10**9)], on_gpu=True)
    train_plan.check_sizes(settings("--total-seq-len", "8192"), SMOL, rows, 4, 2048, big, "bfloat16")


def test_a_warmup_the_packed_steps_may_not_reach_is_a_warning(caplog):
    # 24 rows of 512 tokens, 22 to train on: at most 22 steps an epoch (a row a step), at least 2 (8,192 tokens a step)
    rows = [([1] * 512, [1] * 512)] * 24
    big = train_plan.Device([("H200", 141 * 10**9)], on_gpu=True)
    with pytest.raises(UsageError, match="--warmup-steps 44: the run takes at most 44 steps"):
        train_plan.check_sizes(settings("--total-seq-len", "8192", "--epochs", "2", "--warmup-steps", "44"), SMOL,
                               rows, 4, 2048, big, "bfloat16")
    with caplog.at_level("WARNING", logger="eagle3"):
        train_plan.check_sizes(settings("--total-seq-len", "8192", "--epochs", "2", "--warmup-steps", "3"), SMOL,
                               rows, 4, 2048, big, "bfloat16")
        assert not caplog.records
        train_plan.check_sizes(settings("--total-seq-len", "8192", "--epochs", "2", "--warmup-steps", "30"), SMOL,
                               rows, 4, 2048, big, "bfloat16")
    assert "--warmup-steps 30: the run may take as few as 4 steps" in caplog.text


def test_saved_epochs_follow_speculators_rule():
    assert train_plan.saved_epochs(10, 1.0) == 10 and train_plan.saved_epochs(10, 0.5) == 10
    assert train_plan.saved_epochs(6, 2.0) == 4  # epoch 0, then each e with (e + 1) % 2 == 0: 1, 3, 5
    # the SmolLM2 draft: 69 MB of bf16 weights (its embedding included) and Muon's 10 MB, as measured
    assert 75e6 < train_plan.checkpoint_bytes(SMOL, 1, 2048, "muon") < 85e6


def test_a_different_run_is_named_setting_by_setting(tmp_path):
    out = tmp_path / "ck"
    out.mkdir()
    s = settings("--output-dir", str(out), "--lr", "2e-3")
    prep, ext, voc = {"content_id": "p1"}, train_data.States((2, 4), 8, "bf16", "e1"), {"content_id": "v1"}
    recipe = {"draft_arch": "llama", "scheduler_type": "linear"}
    same = train_plan.run_identity(s, prep, ext, voc, recipe, "bfloat16")
    (out / files.RUN_FILE).write_text(json.dumps({"stage": "train", "identity": same, "epochs": 10, "max_steps": None}))
    assert train_plan.check_resume(s, same)["identity"] == same
    # the identity holds the compute dtype as resolved: `--dtype auto` that resolves to the same one is the same run
    auto = settings("--output-dir", str(out), "--lr", "2e-3", "--dtype", "auto")
    assert train_plan.check_resume(auto, train_plan.run_identity(
        auto, prep, ext, voc, recipe, compute.resolve("auto", on_gpu=True).dtype))["identity"] == same
    other = train_plan.run_identity(settings("--output-dir", str(out), "--seed", "4"), prep, train_data.States((2, 4), 8, "bf16", "e2"), voc,
                                    {**recipe, "scheduler_type": "cosine"}, "bfloat16")
    with pytest.raises(UsageError) as e:
        train_plan.check_resume(s, other)
    assert "--hidden-states (its content id) e1 -> e2; --lr 0.002 -> 0.003; --seed 0 -> 4; --scheduler linear -> " \
           "cosine" in str(e.value) and "--overwrite" in str(e.value)
    assert train_plan.check_resume(settings("--output-dir", str(out), "--overwrite"), other) is None
    # trained in bf16, rerun in float32: the optimizer's states and the weights would continue in another precision
    f32 = settings("--output-dir", str(out), "--lr", "2e-3", "--epochs", "2", "--dtype", "float32")
    with pytest.raises(UsageError) as e:
        train_plan.check_resume(f32, train_plan.run_identity(f32, prep, ext, voc, recipe, "float32"))
    assert str(e.value).count("\n") == 0 and "(--dtype bfloat16 -> float32)" in str(e.value)
    assert "--overwrite to restart" in str(e.value)


def test_an_input_rewritten_under_a_run_is_one_line(tmp_path):
    jsonl = tmp_path / "tokenized_data.jsonl"
    jsonl.write_text('{"input_ids": [1], "loss_mask": [1]}\n')
    cid = input_watch.file_digest(str(jsonl))
    (tmp_path / "manifest.json").write_text(json.dumps({"content_id": cid}))
    w = input_watch.stage01("--prepared-data", str(jsonl), {"content_id": cid})
    w.check(full=True)
    jsonl.write_text('{"input_ids": [2], "loss_mask": [1]}\n')
    with pytest.raises(RunError, match="tokenized_data.jsonl was rewritten"):
        w.check()
    os.unlink(tmp_path / "manifest.json")
    with pytest.raises(RunError, match=r"--prepared-data .*: changed while this stage ran \(its manifest.json is gone"):
        w.check()
