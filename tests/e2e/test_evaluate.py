"""Stage 05 end to end: a stage 04 folder's checkpoints ranked by acceptance through vLLM on the same held-out
prompts, the best one's report in full, and the trainer's estimate beside vLLM's measurement."""
import json
import os
import shutil

from conftest import run_script


def test_report_ranks_a_stage04_folder_s_checkpoints(model_path, stages, trained, tmp_path):
    out, _ = trained
    two = tmp_path / "draft"  # the trained run with two of its checkpoints: an early one and the last
    shutil.copytree(out, two, symlinks=True)
    for name in os.listdir(two):
        if (name.isdigit() and name not in ("1", "5")) or os.path.islink(two / name):
            shutil.rmtree(two / name) if not os.path.islink(two / name) else os.unlink(two / name)
    ev = tmp_path / "ev"
    p, _ = run_script("05_evaluate.py", "--model-path", model_path, "--draft", str(two), "--prepared-data",
                      str(stages["prepared"]), "--num-prompts", "4", "--max-new-tokens", "32", "--batch-sizes", "1,4",
                      "--output-dir", str(ev))
    assert p.returncode == 0, p.stderr[-4000:]
    rep = json.load(open(ev / "report.json"))
    ranking = rep["ranking"]
    assert sorted(r["name"] for r in ranking) == ["1", "5"]
    assert ranking[0]["acceptance_length"] >= ranking[1]["acceptance_length"]
    assert rep["draft"] == ranking[0]["draft"] == str(two / ranking[0]["name"])
    assert all(r["trainer"] and r["trainer"] > 1 for r in ranking)  # each epoch's validation estimate
    rec = rep["trainer_vs_vllm"]
    assert rec["trainer"] > 1 and rec["vllm"] == rep["speculative"]["1"]["acceptance_length"]
    assert len(rec["per_position"]) == 3
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
    assert "checkpoints by acceptance length through vLLM" in p.stdout and "trainer's estimate" in p.stdout
    from eagle3pipe import compute  # every engine computed in auto's dtype; what they printed is in engine.log
    assert rep["compute_dtype"] == compute.resolve("auto", on_gpu=False).dtype
    assert (ev / "engine.log").read_text().count("non-default args") == 3  # the baseline and each checkpoint
    assert "non-default args" not in p.stderr + p.stdout and "EngineCore" not in p.stderr + p.stdout
