"""Stage 04 trains toward the verifier's own next-token distribution, whatever the family (eagle3pipe/target_check.py):
on a few stored rows, speculators' targets (the draft family's RMSNorm holding the verifier's norm weight, then its
head) are compared with the verifier's own head run by transformers' class for the family. Llama-style norms agree
as they are; Gemma's `x * (1 + w)` norm (random norm weights: with the zeros a random init gives, both norms agree)
trains through the verifier's own norm in speculators' place; a family that also caps its logits (Gemma 2) is
refused in one line before training."""
from verifiers import stage04_plan as _plan, stages_01_to_03 as _stages


def test_llama_targets_are_the_verifiers_own(stages, model_path, tmp_path):
    v = _plan(model_path, stages, tmp_path / "out").targets
    assert not v.use_own_norm and v.top1 >= 0.99 and v.kl < 1e-3 and v.positions > 100, v
    assert "as speculators computes them" in v.describe()


def test_gemma_targets_go_through_its_own_norm(model_path, tmp_path):
    """A random Gemma 3 (norm weights random): speculators' default targets agree with its own on few positions;
    through its own final norm on all of them (training that way, and Gemma 2's cap refused: tests/slow/
    test_targets.py)."""
    from verifiers import dense
    gemma3 = dense(str(tmp_path / "gemma3"), model_path, "Gemma3TextConfig", layers=8, head_dim=16,
                   sliding_window=64, layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2)
    d = _stages(gemma3, tmp_path / "g3")
    v = _plan(gemma3, d, tmp_path / "out3").targets
    assert v.use_own_norm and v.top1 >= 0.99 and v.kl < 1e-3 and v.default_top1 < 0.9, v
    assert "with the verifier's own final norm in speculators' place" in v.describe()
