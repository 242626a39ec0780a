"""Stage 04 trains toward the verifier's own next-token distribution, whatever the family (eagle3pipe/target_check.py):
on a few stored rows, speculators' targets (the draft family's RMSNorm holding the verifier's norm weight, then its
head) are compared with the verifier's own head run by transformers' class for the family. Llama-style norms agree
as they are; Gemma's `x * (1 + w)` norm (random norm weights: with the zeros a random init gives, both norms agree)
trains through the verifier's own norm in speculators' place; a family that also caps its logits (Gemma 2) is
refused in one line before training."""
import os

import pytest

from conftest import load_script, run_script


def _plan(model, d, out):
    from eagle3pipe import train_plan
    args = load_script("04_train.py").parse_args(
        ["--model-path", str(model), "--prepared-data", str(d["prepared"]), "--hidden-states", str(d["hs"]),
         "--vocab-mapping", str(d["vocab"]), "--output-dir", str(out), "--total-seq-len", "1024",
         "--measure-prompts", "0"])
    return train_plan.plan(args, 0)


def _stages(model, root):
    d = {k: root / k for k in ("prepared", "hs", "vocab")}
    for argv in (["01_prepare_dataset.py", "--model-path", model, "--num-samples", "8", "--max-seq-len", "256",
                  "--output-dir", str(d["prepared"])],
                 ["02_extract_hidden_states.py", "--backend", "hf", "--model-path", model, "--prepared-data",
                  str(d["prepared"]), "--output-dir", str(d["hs"]), "--max-seq-len", "256", "--dtype", "float32"],
                 ["03_build_vocab_mapping.py", "--prepared-data", str(d["prepared"]), "--draft-vocab-size", "1024",
                  "--output-dir", str(d["vocab"])]):
        p, _ = run_script(*argv)
        assert p.returncode == 0, p.stderr[-3000:]
    return d


def test_llama_targets_are_the_verifiers_own(stages, model_path, tmp_path):
    v = _plan(model_path, stages, tmp_path / "out").targets
    assert not v.use_own_norm and v.top1 >= 0.99 and v.kl < 1e-3 and v.positions > 100, v
    assert "as speculators computes them" in v.describe()


def test_gemma_trains_through_its_own_norm_and_a_capped_family_is_refused(model_path, tmp_path):
    from eagle3pipe.errors import UsageError
    from verifiers import dense
    gemma3 = dense(str(tmp_path / "gemma3"), model_path, "Gemma3TextConfig", layers=8, head_dim=16,
                   sliding_window=64, layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2)
    d = _stages(gemma3, tmp_path / "g3")
    v = _plan(gemma3, d, tmp_path / "out3").targets
    assert v.use_own_norm and v.top1 >= 0.99 and v.kl < 1e-3 and v.default_top1 < 0.9, v
    assert "with the verifier's own final norm in speculators' place" in v.describe()
    # trained that way: the run says so before its first step, and its checkpoint holds no verifier norm
    out = tmp_path / "ckpt3"
    p, _ = run_script("04_train.py", "--model-path", gemma3, "--prepared-data", str(d["prepared"]), "--hidden-states",
                      str(d["hs"]), "--vocab-mapping", str(d["vocab"]), "--output-dir", str(out), "--total-seq-len",
                      "512", "--max-steps", "2", "--measure-prompts", "0", "--log-every", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "with the verifier's own final norm in speculators' place" in p.stderr, p.stderr[-3000:]
    from safetensors import safe_open
    with safe_open(os.path.join(os.path.realpath(out / "last"), "model.safetensors"), "pt") as f:
        assert not any(k.startswith("verifier_norm") for k in f.keys())
    # Gemma 2 also caps its logits (c * tanh(x / c)): the same top token, another distribution (c = 30 in its real
    # configs, where logits reach it; a random model's stay small, so the cap here is where they are)
    gemma2 = dense(str(tmp_path / "gemma2"), model_path, "Gemma2Config", layers=8, head_dim=16,
                   final_logit_softcapping=0.02)
    d = _stages(gemma2, tmp_path / "g2")
    with pytest.raises(UsageError, match=r"speculators would train the draft toward targets that are not the "
                                         r"verifier's: .* a Gemma2ForCausalLM's own next token .* its family \(gemma2\) "
                                         r"computes its logits otherwise"):
        _plan(gemma2, d, tmp_path / "out2")
