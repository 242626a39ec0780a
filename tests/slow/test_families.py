"""The weights check (eagle3pipe/verifier/verifier_weights.py) on the families the default set leaves out: Qwen3, Mixtral's
routed experts and DeepSeek-V3 (MLA, routed experts, the router's bias), each whole and sharded, and every fault
tests/bad_verifiers.py generates from it (the default set: Llama, Gemma 3, Kimi-K2.5's INT4 form, in
tests/reliability/test_verifier_weights.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
import test_verifier_weights as default  # noqa: E402  (its fixture and check, here for the other families)

families = default.families  # the module's fixture, by name


@pytest.mark.parametrize("family", sorted(set(default.ARCH) - set(default.DEFAULT)))
def test_the_other_families(family, families, tmp_path):
    default.test_each_family_matches_its_definition_and_every_generated_fault_is_named(family, families, tmp_path)
