"""vLLM serves a trained draft as an eagle3 speculator with greedy output unchanged, in float32 (exact equality).
The default set serves drafts through stage 05 (tests/e2e/test_evaluate.py) and the recipe test
(tests/e2e/test_recipe.py); this one holds the exact-equality property."""
import json
import subprocess
import sys

from conftest import REPO


def test_vllm_serves_the_draft_and_greedy_output_is_unchanged(trained, model_path):
    out, _ = trained
    code = f"""
import json, os, sys
sys.path.insert(0, {REPO!r})
from eagle3pipe.engines.engine import cpu_vllm_env
cpu_vllm_env()
from vllm import LLM, SamplingParams
prompts = [[{{"role": "user", "content": q}}] for q in ("What is the capital of France?", "Name three colors.")]
sp = SamplingParams(max_tokens=24, temperature=0.0)
def run(**kw):
    # float32: bf16 verification of several positions at once rounds differently from one-token decoding,
    # which can flip near-ties; the property under test is that the draft never changes the greedy choice
    llm = LLM(model={model_path!r}, max_model_len=1024, enforce_eager=True, enable_prefix_caching=False,
              disable_log_stats=False, dtype="float32", **kw)
    outs = [llm.chat(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    m = {{x.name: getattr(x, "value", None) for x in llm.get_metrics()}}
    del llm
    return [list(o) for o in outs], m
base, _ = run()
spec, m = run(speculative_config={{"method": "eagle3", "model": {str(out / "last")!r}, "num_speculative_tokens": 3}},
              )
print("RESULT", json.dumps({{"same": base == spec, "drafts": m.get("vllm:spec_decode_num_drafts")}}))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900)
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
    assert line, p.stderr[-4000:]
    res = json.loads(line[0][7:])
    assert res["same"] is True
    assert res["drafts"] and res["drafts"] > 0
