"""Stage 04 trains a Gemma 3 draft through the verifier's own final norm (its log says so before step 1, the
checkpoint holds no verifier norm, and no serve command this vLLM cannot run is printed), stage 05 gives its
acceptance measure without vLLM (which has no EAGLE-3 for the family), and stage 04 refuses a Gemma 2 whose
logit cap moves the distribution (eagle3pipe/train/target_check.py; the plan-level checks: tests/e2e/test_targets.py)."""
import json
import os

import pytest

from conftest import run_script
from verifiers import stage04_plan as _plan, stages_01_to_03 as _stages


def test_gemma_trains_through_its_own_norm_and_a_capped_family_is_refused(model_path, tmp_path):
    from eagle3pipe.base.errors import UsageError
    from verifiers import dense, gemma3
    model = gemma3(str(tmp_path / "gemma3"), model_path)
    d = _stages(model, tmp_path / "g3")
    # trained through its own norm (the check: tests/e2e/test_targets.py): the run says so before its first step, and its checkpoint holds no verifier norm
    out = tmp_path / "ckpt3"
    p, _ = run_script("04_train.py", "--model-path", model, "--prepared-data", str(d["prepared"]), "--hidden-states",
                      str(d["hs"]), "--vocab-mapping", str(d["vocab"]), "--output-dir", str(out), "--total-seq-len",
                      "512", "--max-steps", "2", "--measure-prompts", "0", "--log-every", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "with the verifier's own final norm in speculators' place" in p.stderr, p.stderr[-3000:]
    # this vLLM cannot serve a Gemma 3 draft: said, and no serve command that cannot work is printed
    assert "serve it with a vLLM that has EAGLE-3 support for Gemma3ForCausalLM" in p.stderr, p.stderr[-2000:]
    assert "serve it" not in p.stdout, p.stdout[-2000:]
    from safetensors import safe_open
    with safe_open(os.path.join(os.path.realpath(out / "last"), "model.safetensors"), "pt") as f:
        assert not any(k.startswith("verifier_norm") for k in f.keys())
    # stage 05: vLLM has no EAGLE-3 for the family, so the acceptance measure alone, labelled, the reason named
    ev = tmp_path / "ev3"
    p, _ = run_script("05_evaluate.py", "--model-path", model, "--draft", str(out / "last"), "--prepared-data",
                      str(d["prepared"]), "--num-prompts", "2", "--max-new-tokens", "16", "--dtype", "float32",
                      "--output-dir", str(ev))
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.load(open(ev / "report.json"))
    assert rep["engine"] == "measure" and "no EAGLE-3 support for Gemma3ForCausalLM" in rep["without_vllm"], rep
    assert 1 <= rep["acceptance_length"] <= 4 and len(rep["per_position"]) == 3 and rep["speedup"] is None, rep
    assert "speed-up needs vLLM" in p.stdout
    p, _ = run_script("05_evaluate.py", "--model-path", model, "--draft", str(out / "last"), "--prepared-data",
                      str(d["prepared"]), "--output-dir", str(tmp_path / "ev3on"), "--vllm", "on")
    assert p.returncode == 2 and "--vllm on" in p.stderr and not (tmp_path / "ev3on").exists(), p.stderr[-2000:]
    # Gemma 2 also caps its logits (c * tanh(x / c)): the same top token, another distribution (c = 30 in its real
    # configs, where logits reach it; a random model's stay small, so the cap here is where they are)
    gemma2 = dense(str(tmp_path / "gemma2"), model_path, "Gemma2Config", layers=8, head_dim=16,
                   final_logit_softcapping=0.02)
    d = _stages(gemma2, tmp_path / "g2")
    with pytest.raises(UsageError, match=r"speculators would train the draft toward targets that are not the "
                                         r"verifier's: .* a Gemma2ForCausalLM's own next token .* its family \(gemma2\) "
                                         r"computes its logits otherwise"):
        _plan(gemma2, d, tmp_path / "out2")


def test_gemma_targets_go_through_its_own_norm(model_path, tmp_path):
    """A random Gemma 3 (norm weights random): speculators' default targets agree with its own on few positions;
    through its own final norm on all of them (training that way, and Gemma 2's cap refused: below)."""
    from verifiers import gemma3
    model = gemma3(str(tmp_path / "gemma3"), model_path)
    d = _stages(model, tmp_path / "g3")
    v = _plan(model, d, tmp_path / "out3").targets
    assert v.use_own_norm and v.top1 >= 0.99 and v.kl < 1e-3 and v.default_top1 < 0.9, v
    assert "with the verifier's own final norm in speculators' place" in v.describe()
