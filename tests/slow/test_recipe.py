"""The draft's recipe and stage 05 end to end. A draft trained for two epochs with every recipe lever away from its
default (a Qwen3-style layer, EAGLE-3.1's per-layer norms in place of the single one, no output norm, a weighted
loss, decayed TTT steps, AdamW, cosine) records its recipe and carries it in each checkpoint's config; stage 05
serves both checkpoints and the session's Llama-style draft through vLLM on the same held-out prompts, ranks them,
reports the best in full, and puts the trainer's estimate beside vLLM's measurement.

The same run checks the acceptance measure on three checkpoints (the default set's tests/e2e/test_evaluate.py on one): at batch size 1 in float32, acceptance measured without vLLM
(eagle3pipe/measures/acceptance.py: the verifier's greedy continuation and states through transformers, one TTT forward of
the draft, vLLM's rounds replayed) equals vLLM's own counters for each checkpoint, so the chain is checked end to
end (states, layer ids, shift, vocabulary map, stop ids) on both layer kinds. The rounds' finer rules (the first
point, the overshoot past the stop) move the figures by less than the tolerance, so tests/unit/test_acceptance.py
pins them. These small drafts accept little past the first position (the Llama-style one about one draft in
six); the later steps (the draft's fed-back state) were checked on stronger drafts at k=3 and k=5, where vLLM's
counts and the measure's were equal (docs/RECIPE.md). tests/slow/test_acceptance.py repeats the check on the
Llama-style draft alone, on more prompts."""
import json
import os

from conftest import assert_refused, assert_stage05_report, run_script, train_args

RECIPE = ["--draft-arch", "qwen3", "--fc-norm", "--no-norm-output", "--loss-fn", '{"kl_div": 0.5, "tv": 0.5}',
          "--ttt-step-loss-decay", "0.8", "--optimizer", "adamw", "--scheduler", "cosine"]


def test_every_lever_trains_and_stage05_ranks_the_checkpoints_through_vllm(model_path, stages, trained, short_prompts,
                                                                          tmp_path):
    out = tmp_path / "recipe"
    p, _ = run_script(*train_args(model_path, stages, out, "--epochs", "2", "--lr", "3e-3", *RECIPE))
    assert p.returncode == 0, p.stderr[-3000:]
    man = json.load(open(out / "manifest.json"))
    assert man["recipe"] == {"draft_arch": "qwen3", "norm_before_fc": False, "fc_norm": True, "norm_output": False,
                             "loss_fn": '{"kl_div": 0.5, "tv": 0.5}', "ttt_step_loss_decay": 0.8,
                             "optimizer": "adamw", "scheduler_type": "cosine"}
    for epoch in ("0", "1"):
        cfg = json.load(open(out / epoch / "config.json"))
        assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
        assert (cfg.get("fc_norm"), cfg.get("norm_before_fc"), cfg.get("norm_output")) == (True, False, False), cfg
        assert json.load(open(out / epoch / "val_metrics.json"))["expected_acceptance_length"] > 1
    assert man["best_expected_acceptance"] > 1 and os.path.islink(out / "checkpoint_best")
    # the same folder with another recipe is another run: refused, not resumed
    p, secs = run_script(*train_args(model_path, stages, out, "--epochs", "2", "--lr", "1e-3"))
    assert_refused(p, secs, "holds a run with other settings", "--lr 0.003 -> 0.001", "--draft-arch qwen3 -> llama",
                   "--optimizer adamw -> muon", "--overwrite")

    ev = tmp_path / "ev"
    session = trained[0] / "last"  # the session's Llama-style draft (Muon) accepts more: a stronger check
    p, _ = run_script("05_evaluate.py", "--model-path", model_path, "--draft", str(out), str(session), "--prompts",
                      str(short_prompts), "--prepared-data", str(stages["prepared"]), "--num-prompts", "6",
                      "--max-new-tokens", "24", "--num-speculative-tokens", "3", "--batch-sizes", "1", "--dtype",
                      "float32", "--measure", "on", "--output-dir", str(ev))
    assert p.returncode == 0, p.stderr[-4000:]
    rep = json.load(open(ev / "report.json"))
    ranking = rep["ranking"]
    last = os.path.basename(os.path.realpath(session))
    assert sorted(r["name"] for r in ranking) == ["draft/" + last, "recipe/0", "recipe/1"], ranking
    assert [r["acceptance_length"] for r in ranking] == sorted((r["acceptance_length"] for r in ranking), reverse=True)
    assert rep["draft"] == ranking[0]["draft"] == os.path.realpath(
        {"recipe/0": out / "0", "recipe/1": out / "1"}.get(ranking[0]["name"], session))
    assert all(r["trainer"] and r["trainer"] > 1 for r in ranking)  # each epoch's validation estimate
    assert "checkpoints by acceptance length through vLLM" in p.stdout and " ms a round" in p.stdout
    assert ranking[0]["tokens_per_s"] == rep["speculative"]["1"]["tokens_per_s"]  # the best one's run is the report's
    assert_stage05_report(ev, p, rep, engines=4)  # the baseline and three checkpoints
