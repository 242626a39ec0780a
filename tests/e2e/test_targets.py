"""Stage 04 trains toward the verifier's own next-token distribution, whatever the family (eagle3pipe/train/target_check.py):
on a few stored rows, speculators' targets (the draft family's RMSNorm holding the verifier's norm weight, then its
head) are compared with the verifier's own head run by transformers' class for the family. Llama-style norms agree
as they are (here); Gemma's `x * (1 + w)` norm trains through the verifier's own norm in speculators' place, and a
family that also caps its logits (Gemma 2) is refused in one line before training (tests/slow/
test_gemma_targets.py)."""
from verifiers import stage04_plan as _plan


def test_llama_targets_are_the_verifiers_own(stages, model_path, tmp_path):
    v = _plan(model_path, stages, tmp_path / "out").targets
    assert not v.use_own_norm and v.top1 >= 0.99 and v.kl < 1e-3 and v.positions > 100, v
    assert "as speculators computes them" in v.describe()
