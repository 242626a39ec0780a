"""Stage 05 through its command line: refusals before any model loads, held-out prompt selection, and (e2e)
the report for a trained draft through vLLM."""
import json
import os

import pytest

from conftest import run_script
from test_cli_prepare_vocab import assert_refused


def test_refusals(model_path, stages, trained, tmp_path):
    out, _ = trained
    not_eagle = tmp_path / "not-eagle"
    not_eagle.mkdir()
    json.dump({"speculators_model_type": "mtp"}, open(not_eagle / "config.json", "w"))
    wrong_size = tmp_path / "wrong-size"
    wrong_size.mkdir()
    cfg = json.load(open(out / "last" / "config.json"))
    cfg["transformer_layer_config"]["hidden_size"] = 4096
    json.dump(cfg, open(wrong_size / "config.json", "w"))
    cases = [
        (["--draft", str(tmp_path / "nope")], ["--draft", "no config.json"]),
        (["--draft", str(not_eagle)], ["not an eagle3 speculators checkpoint"]),
        (["--draft", str(wrong_size)], ["hidden size 4096", "576"]),
        (["--batch-sizes", "0"], ["--batch-sizes [0]"]),
        (["--batch-sizes", "x"], ["--batch-sizes", "integers"]),
        (["--prompts", str(tmp_path / "none.jsonl")], ["--prompts", "no such file"]),
        (["--num-prompt", "3"], ["did you mean --num-prompts"]),
    ]
    for extra, needles in cases:
        p, secs = run_script("05_evaluate.py", "--model-path", model_path, "--draft", str(out / "last"),
                             "--output-dir", str(tmp_path / "ev"), *extra)
        assert_refused(p, secs, *needles)


def test_prompts_are_held_out(stages):
    import argparse
    from eagle3pipe import conversations, evaluation
    man = json.load(open(stages["prepared"] / "manifest.json"))
    skip = man["counts"]["records_read"]
    args = argparse.Namespace(prompts="sharegpt", num_prompts=5)
    prompts = evaluation.select_prompts(args, skip)
    trained_firsts = set()
    for i, (where, rec) in enumerate(conversations.iter_records("sharegpt")):
        if i >= skip:
            break
        _, msgs = conversations.normalize(where, rec)
        trained_firsts.update(m["content"] for m in msgs if m["role"] == "user")
    assert len(prompts) == 5
    for p in prompts:
        assert p[-1]["role"] == "user" and p[-1]["content"] not in trained_firsts


@pytest.mark.e2e
def test_report_for_a_trained_draft(model_path, stages, trained, tmp_path):
    out, _ = trained
    ev = tmp_path / "ev"
    p, _ = run_script("05_evaluate.py", "--model-path", model_path, "--draft", str(out / "last"), "--prepared-data",
                      str(stages["prepared"]), "--num-prompts", "4", "--max-new-tokens", "32", "--batch-sizes", "1,4",
                      "--output-dir", str(ev))
    assert p.returncode == 0, p.stderr[-4000:]
    rep = json.load(open(ev / "report.json"))
    for b in ("1", "4"):
        s = rep["speculative"][b]
        assert s["drafts"] > 0 and 1.0 <= s["acceptance_length"] <= 4.0
        assert len(s["per_position"]) == 3 and all(0 <= x <= 1 for x in s["per_position"])
        assert s["per_position"][0] >= s["per_position"][-1]  # a later token is accepted only after earlier ones
        assert rep["baseline"][b]["tokens_per_s"] > 0 and s["tokens_per_s"] > 0
        assert rep["baseline"][b]["output_tokens"] > 0
    assert rep["greedy_identical_at_batch_1"].endswith("/4")
    assert os.path.getsize(ev / "acceptance.png") > 10_000
    assert "accept len" in p.stdout and "greedy outputs identical" in p.stdout
    from eagle3pipe import compute  # both engines computed in auto's dtype; what they printed is in engine.log
    assert rep["compute_dtype"] == compute.resolve("auto", on_gpu=False).dtype
    assert (ev / "engine.log").read_text().count("non-default args") == 2
    assert "non-default args" not in p.stderr + p.stdout and "EngineCore" not in p.stderr + p.stdout
