"""Every bad draft folder of tests/bad_drafts.py (the default set takes every fourth: tests/reliability/
test_bad_drafts.py), and the MLA draft with its vllm/ copy."""
import json
import os

import pytest

from bad_drafts import (FAMILIES, LAYER, MISSING, base_of, cut, edit_tensors, refuse_all, set_field, tensor_of,
                        write_st)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_bad_draft_is_refused_in_one_line_before_anything_loads(family, draft_base, model_path, tmp_path):
    refuse_all(model_path, draft_base, tmp_path, FAMILIES[family]())


def test_an_mla_draft_and_its_vllm_copy(ds, ds_mla, tmp_path):
    """The MLA draft is served from its vllm/ copy: a copy missing, saying other sizes, or holding other weights is
    refused like the checkpoint itself; the untouched checkpoint passes."""
    from eagle3pipe.measures import draft_check
    from eagle3pipe.verifier import verifier
    _, ckpt = ds_mla
    src = os.path.realpath(ckpt / "last")
    fp, tc = verifier.open_verifier(ds["model"], False)
    assert draft_check.check_folder(src, json.load(open(os.path.join(src, "config.json"))), tc)["kind"] == \
        "deepseek_v3"
    cfg, tensors = base_of(src)
    served = json.load(open(os.path.join(src, "vllm", "config.json")))

    def copy_says(key, value):
        def mutate(c, t, folder, rng):
            os.mkdir(os.path.join(folder, "vllm"))
            json.dump({**served, key: value}, open(os.path.join(folder, "vllm", "config.json"), "w"))
            write_st(os.path.join(folder, "model.safetensors"), t)
            os.link(os.path.join(folder, "model.safetensors"), os.path.join(folder, "vllm", "model.safetensors"))
            return True
        return mutate

    def copy_weights(fn):
        def mutate(c, t, folder, rng):
            os.mkdir(os.path.join(folder, "vllm"))
            json.dump(served, open(os.path.join(folder, "vllm", "config.json"), "w"))
            write_st(os.path.join(folder, "model.safetensors"), t)
            fn(os.path.join(folder, "vllm", "model.safetensors"), t, rng)
            return True
        return mutate

    cases = [("no vllm/ copy", lambda c, t, f, r: None),
             ("the copy's draft_vocab_size", copy_says("draft_vocab_size", 2048)),
             ("the copy's layer ids", copy_says("eagle_aux_hidden_state_layer_ids", [1, 4, 5])),
             ("the copy's layers", copy_says("num_hidden_layers", 2)),
             ("the copy's weights missing", copy_weights(lambda p, t, r: None)),
             ("the copy's weights cut short", copy_weights(cut(lambda s, n, r: s // 2))),
             ("the copy's weights without fc", copy_weights(lambda p, t, r: write_st(
                 p, {k: v for k, v in t.items() if k != "fc.weight"}))),
             ("kv_a_proj_with_mqa reshaped", edit_tensors(lambda t, r: t.__setitem__(
                 "layers.0.self_attn.kv_a_proj_with_mqa.weight", tensor_of("BF16", [576, 256], r)))),
             ("delete kv_lora_rank", LAYER + "kv_lora_rank", set_field(LAYER + "kv_lora_rank", MISSING)),
             ("qk_rope_head_dim = 0", LAYER + "qk_rope_head_dim", set_field(LAYER + "qk_rope_head_dim", 0))]
    refuse_all(ds["model"], (cfg, tensors), tmp_path, cases)
