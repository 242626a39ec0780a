"""Held-out bad draft folders (tests/bad_drafts.py) generated from the session's `trained` draft: stage 05 must
refuse each through its command line in one `error:` line naming the draft folder, exit 2, before any heavy import,
writing nothing; the untouched checkpoint must pass the same checks. The default set takes every fourth case of each
family (a fixed, seeded choice); tests/slow/test_bad_drafts.py takes them all, and the MLA draft's."""
import json
import random

import pytest

from bad_drafts import FAMILIES, LAYER, SEED, build, refuse_all, set_field, sharded, tensor_of

EVERY = 4  # the default set's share of each family: the slow set runs every case


def test_the_lean_base_passes_the_checks(draft_base, model_path, tmp_path):
    """Every mutant starts from this folder (and the index family from its sharded form): both must pass, or the
    refusals below would prove nothing."""
    from eagle3pipe.measures import draft_check
    from eagle3pipe.verifier import verifier
    build(*draft_base, tmp_path / "lean", lambda *a: None, random.Random(SEED))
    build(*draft_base, tmp_path / "sharded", sharded(lambda d, i: None), random.Random(SEED))
    fp, tc = verifier.open_verifier(model_path, False)
    for folder in ("lean", "sharded"):
        cfg = json.load(open(tmp_path / folder / "config.json"))
        assert draft_check.check_folder(str(tmp_path / folder), cfg, tc)["layers"] == 1
    # what vLLM does load passes too: the biases with their tensors, llama3 rope with every key get_rope reads
    def biased(cfg, t, folder, rng):
        cfg["transformer_layer_config"].update(attention_bias=True, mlp_bias=True)
        for w in [k for k in t if k.endswith("_proj.weight")]:
            t[w[:-len("weight")] + "bias"] = tensor_of("BF16", [t[w][1][0]], rng)
    llama3 = set_field(LAYER + "rope_parameters", {"rope_type": "llama3", "rope_theta": 1e5, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    for name, mutate in [("biased", biased), ("llama3", llama3)]:
        build(*draft_base, tmp_path / name, mutate, random.Random(SEED))
        cfg = json.load(open(tmp_path / name / "config.json"))
        assert draft_check.check_folder(str(tmp_path / name), cfg, tc)["layers"] == 1, name


@pytest.mark.parametrize("family", ["config", "weights", "index"])
def test_bad_drafts_are_refused_in_one_line_before_anything_loads(family, draft_base, model_path, tmp_path):
    refuse_all(model_path, draft_base, tmp_path, FAMILIES[family]()[::EVERY])
