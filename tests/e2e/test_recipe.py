"""The draft's recipe levers end to end: a draft trained a few steps with every lever away from its default (a
Qwen3-style layer, EAGLE-3.1's per-layer norms in place of the single one, no output norm, a weighted loss, decayed TTT steps, AdamW, cosine)
records its recipe, carries it in the checkpoint's config, and is served by vLLM as an eagle3 draft."""
import json
import subprocess
import sys

from conftest import REPO, assert_refused, run_script, train_args

RECIPE = ["--draft-arch", "qwen3", "--fc-norm", "--no-norm-output", "--loss-fn",
          '{"kl_div": 0.5, "tv": 0.5}', "--ttt-step-loss-decay", "0.8", "--optimizer", "adamw", "--scheduler", "cosine"]


def test_every_lever_trains_and_vllm_serves_the_draft(model_path, stages, tmp_path):
    out = tmp_path / "draft"
    p, _ = run_script(*train_args(model_path, stages, out, "--epochs", "1", "--max-steps", "4", *RECIPE))
    assert p.returncode == 0, p.stderr[-3000:]
    recipe = json.load(open(out / "manifest.json"))["recipe"]
    assert recipe == {"draft_arch": "qwen3", "norm_before_fc": False, "fc_norm": True, "norm_output": False,
                      "loss_fn": '{"kl_div": 0.5, "tv": 0.5}', "ttt_step_loss_decay": 0.8, "optimizer": "adamw",
                      "scheduler_type": "cosine"}
    cfg = json.load(open(out / "last" / "config.json"))
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
    assert (cfg.get("fc_norm"), cfg.get("norm_before_fc"), cfg.get("norm_output")) == (True, False, False), cfg
    # the same folder with another recipe is another run: refused, not resumed
    p, secs = run_script(*train_args(model_path, stages, out, "--epochs", "1", "--max-steps", "4"))
    assert_refused(p, secs, "holds checkpoints of another run (recipe differs)")
    code = f"""
import json
from eagle3pipe.engine import cpu_vllm_env
cpu_vllm_env()
from vllm import LLM, SamplingParams
llm = LLM(model={model_path!r}, max_model_len=512, enforce_eager=True, enable_prefix_caching=False,
          disable_log_stats=False, dtype="float32",
          speculative_config={{"method": "eagle3", "model": {str(out / "last")!r}, "num_speculative_tokens": 3}})
o = llm.chat([{{"role": "user", "content": "Name three colors."}}], SamplingParams(max_tokens=16, temperature=0.0),
             use_tqdm=False)[0].outputs[0].token_ids
m = {{x.name: getattr(x, "value", None) for x in llm.get_metrics()}}
print("RESULT", json.dumps({{"tokens": len(o), "drafts": m.get("vllm:spec_decode_num_drafts")}}))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
    assert line, p.stderr[-4000:]
    res = json.loads(line[0][7:])
    assert res["tokens"] > 0 and res["drafts"] and res["drafts"] > 0, res
