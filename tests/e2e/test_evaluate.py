"""Stage 05 end to end on the embedded default: the session's trained draft (a Llama-style layer, Muon)
served by vLLM beside the verifier alone on 4 short held-out prompts, in float32 at batch size 1, then the
acceptance measure that needs no vLLM (eagle3pipe/measures/acceptance.py: the verifier's greedy continuation and states
through transformers, one TTT forward of the draft, vLLM's rounds replayed) alone on the same prompts (--vllm off).

The measure's agreement with vLLM's own counters checks the whole chain end to end (states, layer ids, shift,
vocabulary map, stop ids); its finer rules are pinned by tests/unit/test_acceptance.py. Several checkpoints of two
layer kinds, ranked, with every recipe lever: tests/slow/test_recipe.py."""
import json
import os

from conftest import MEASURE_LENGTH, MEASURE_POSITION, assert_stage05_report, run_script


def test_stage05_serves_the_draft_through_vllm_and_the_measure_agrees(model_path, stages, trained, short_prompts,
                                                                      tmp_path):
    ev = tmp_path / "ev"
    session = trained[0] / "last"
    p, _ = run_script("05_evaluate.py", "--model-path", model_path, "--draft", str(session), "--prompts",
                      str(short_prompts), "--prepared-data", str(stages["prepared"]), "--num-prompts", "4",
                      "--max-new-tokens", "24", "--num-speculative-tokens", "3", "--batch-sizes", "1", "--dtype",
                      "float32", "--measure", "off", "--output-dir", str(ev))
    assert p.returncode == 0, p.stderr[-4000:]
    rep = json.load(open(ev / "report.json"))
    assert rep["draft"] == os.path.realpath(session) and rep["ranking"] is None
    # the baseline, then the draft; the measure runs alone below (beside vLLM, in one run: tests/slow)
    assert_stage05_report(ev, p, rep, engines=2, prompts=4, measured=False)
    assert json.load(open(ev / "manifest.json"))["stage"] == "evaluate"

    # where vLLM does not run (a training cluster without it; a family it has no EAGLE-3 for): the measure alone,
    # labelled so, equal to vLLM's counters on the same prompts within the measure's tolerance
    alone = tmp_path / "alone"
    p, _ = run_script("05_evaluate.py", "--model-path", model_path, "--draft", str(session), "--prompts",
                      str(short_prompts), "--prepared-data", str(stages["prepared"]), "--num-prompts", "4",
                      "--max-new-tokens", "24", "--num-speculative-tokens", "3", "--dtype", "float32", "--vllm",
                      "off", "--output-dir", str(alone))
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.load(open(alone / "report.json"))
    assert got["engine"] == "measure" and got["without_vllm"] == "--vllm off" and got["speedup"] is None, got
    s = rep["speculative"]["1"]
    assert abs(got["acceptance_length"] - s["acceptance_length"]) <= MEASURE_LENGTH, (got, s)
    assert len(got["per_position"]) == 3 and all(abs(a - b) <= MEASURE_POSITION
                                                  for a, b in zip(got["per_position"], s["per_position"])), (got, s)
    assert "no vLLM run (--vllm off): the acceptance measure alone" in p.stderr and "speed-up needs vLLM" in p.stdout
    assert not (alone / "engine.log").exists()  # no engine started
    assert os.path.getsize(alone / "acceptance.png") > 10_000
