"""Stage 05 end to end: the report for a trained draft through vLLM."""
import json
import os


from conftest import run_script


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
