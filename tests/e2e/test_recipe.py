"""The draft's recipe and stage 05 end to end. A draft trained for two epochs with every recipe lever away from its
default (a Qwen3-style layer, EAGLE-3.1's per-layer norms in place of the single one, no output norm, a weighted
loss, decayed TTT steps, AdamW, cosine) records its recipe and carries it in each checkpoint's config; stage 05
serves both checkpoints through vLLM on the same held-out prompts, ranks them, reports the best in full, and puts
the trainer's estimate beside vLLM's measurement."""
import json
import os

from conftest import assert_refused, run_script, train_args

RECIPE = ["--draft-arch", "qwen3", "--fc-norm", "--no-norm-output", "--loss-fn", '{"kl_div": 0.5, "tv": 0.5}',
          "--ttt-step-loss-decay", "0.8", "--optimizer", "adamw", "--scheduler", "cosine"]


def test_every_lever_trains_and_stage05_ranks_the_checkpoints_through_vllm(model_path, stages, tmp_path):
    out = tmp_path / "draft"
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
    p, _ = run_script("05_evaluate.py", "--model-path", model_path, "--draft", str(out), "--prepared-data",
                      str(stages["prepared"]), "--num-prompts", "2", "--max-new-tokens", "16", "--batch-sizes", "1",
                      "--output-dir", str(ev))
    assert p.returncode == 0, p.stderr[-4000:]
    rep = json.load(open(ev / "report.json"))
    ranking = rep["ranking"]
    assert sorted(r["name"] for r in ranking) == ["0", "1"]
    assert ranking[0]["acceptance_length"] >= ranking[1]["acceptance_length"]
    assert rep["draft"] == ranking[0]["draft"] == str(out / ranking[0]["name"])
    assert all(r["trainer"] and r["trainer"] > 1 for r in ranking)  # each epoch's validation estimate
    rec = rep["trainer_vs_vllm"]
    assert rec["trainer"] > 1 and rec["vllm"] == rep["speculative"]["1"]["acceptance_length"]
    assert len(rec["per_position"]) == 3
    for b in ("1",):
        s = rep["speculative"][b]
        assert s["drafts"] > 0 and 1.0 <= s["acceptance_length"] <= 4.0
        assert len(s["per_position"]) == 3 and all(0 <= x <= 1 for x in s["per_position"])
        assert s["per_position"][0] >= s["per_position"][-1]  # a later token is accepted only after earlier ones
        assert rep["baseline"][b]["tokens_per_s"] > 0 and s["tokens_per_s"] > 0
        assert rep["baseline"][b]["output_tokens"] > 0
    assert rep["greedy_identical_at_batch_1"].endswith("/2")
    assert os.path.getsize(ev / "acceptance.png") > 10_000
    assert "accept len" in p.stdout and "greedy outputs identical" in p.stdout
    assert "checkpoints by acceptance length through vLLM" in p.stdout and "trainer's estimate" in p.stdout
    from eagle3pipe import compute  # every engine computed in auto's dtype; what they printed is in engine.log
    assert rep["compute_dtype"] == compute.resolve("auto", on_gpu=False).dtype
    assert (ev / "engine.log").read_text().count("non-default args") == 3  # the baseline and each checkpoint
    assert "non-default args" not in p.stderr + p.stdout and "EngineCore" not in p.stderr + p.stdout
