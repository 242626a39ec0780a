"""Stage 05 end to end on the embedded default: the session's trained draft (a Llama-style layer, Muon)
served by vLLM beside the verifier alone on 16 short held-out prompts, in float32 at batch size 1, with the
acceptance measure that needs no vLLM (eagle3pipe/acceptance.py: the verifier's greedy continuation and states
through transformers, one TTT forward of the draft, vLLM's rounds replayed) run on the same prompts.

The measure's agreement with vLLM's own counters checks the whole chain end to end (states, layer ids, shift,
vocabulary map, stop ids); its finer rules are pinned by tests/unit/test_acceptance.py. Several checkpoints of two
layer kinds, ranked, with every recipe lever: tests/slow/test_recipe.py."""
import json
import os

from conftest import assert_stage05_report, run_script


def test_stage05_serves_the_draft_through_vllm_and_the_measure_agrees(model_path, stages, trained, short_prompts,
                                                                      tmp_path):
    ev = tmp_path / "ev"
    session = trained[0] / "last"
    p, _ = run_script("05_evaluate.py", "--model-path", model_path, "--draft", str(session), "--prompts",
                      str(short_prompts), "--prepared-data", str(stages["prepared"]), "--num-prompts", "4",
                      "--max-new-tokens", "24", "--num-speculative-tokens", "3", "--batch-sizes", "1", "--dtype",
                      "float32", "--measure", "on", "--output-dir", str(ev))
    assert p.returncode == 0, p.stderr[-4000:]
    rep = json.load(open(ev / "report.json"))
    assert rep["draft"] == os.path.realpath(session) and rep["ranking"] is None
    assert_stage05_report(ev, p, rep, engines=2, prompts=4)  # the baseline, then the draft
    assert json.load(open(ev / "manifest.json"))["stage"] == "evaluate"
