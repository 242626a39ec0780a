"""The verifier's weights against its config, before any engine or weight loads (eagle3pipe/verifier/verifier_weights.py):
small random verifiers of several families, built the way transformers saves them (norm weights random too), pass;
the bad folders tests/bad_verifiers.py generates from each (a tensor dropped, added, transposed, reshaped, retyped, a
shard gone, a lying index or header) are refused in one line naming the tensor or the file. Then the stages: each
one that loads the verifier refuses a checkpoint missing one tensor before its engine or weights load, and the HF
backend never runs a verifier transformers filled at random."""
import json
import os
import shutil

import pytest

from bad_verifiers import build, tensors_of, write_sharded
from conftest import run_script

FAMILIES = {  # config class, its own settings: GQA, sliding windows, a 262k vocabulary, routed experts
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 32, "sliding_window": 32, "vocab_size": 262144,
                                    "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False}),
}


@pytest.fixture(scope="module")
def families(tmp_path_factory, model_path, ds, int4):
    """{family: a saved verifier}: the dense and MoE families above (4 layers, width 64), the session's DeepSeek-V3
    (MLA, routed experts with DeepSeek's routing) and its Kimi-K2.5-style INT4 form (compressed-tensors)."""
    from verifiers import dense
    root = tmp_path_factory.mktemp("families")
    out = {name: dense(str(root / name), model_path, cls, layers=4, **extra) for name, (cls, extra) in FAMILIES.items()}
    out.update(deepseek_v3=ds["model"], int4=int4["model"])
    return out


ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
        "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "int4": "DeepseekV3ForCausalLM"}


def _verify(path, trust=False):
    from eagle3pipe.verifier.verifier_weights import verify
    return verify(str(path), trust)


DEFAULT = ("gemma3", "int4", "llama")  # the rest (qwen3, mixtral, deepseek_v3): tests/slow/test_families.py


@pytest.mark.parametrize("family", DEFAULT)
def test_each_family_matches_its_definition_and_every_generated_fault_is_named(family, families, tmp_path):
    from eagle3pipe.base.errors import UsageError
    src = families[family]
    trust = family == "int4"  # its tokenizer ships as code, as Kimi-K2.5's does
    line = _verify(src, trust)
    assert f"match the {ARCH[family]} its config defines" in line, line
    n = len(tensors_of(src))
    assert line.startswith(f"{n:,} tensors"), (line, n)  # every tensor claimed by the definition
    # the same tensors over two shards with an index: the same verdict
    sharded = tmp_path / "sharded"
    shutil.copytree(src, sharded, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    write_sharded(str(sharded), tensors_of(src))
    assert _verify(sharded, trust) == line
    for case, folder, needles in build(src, str(tmp_path), family):
        with pytest.raises(UsageError) as e:
            _verify(folder, trust)
        said = str(e.value)
        assert said.startswith(f"--model-path {folder}: ") and "\n" not in said, (case, said)
        for needle in needles:
            assert needle in said, (family, case, needle, said)


def test_tied_heads_and_declared_skips_come_from_the_model(families, tmp_path):
    """A tied head stored anyway passes in its shape; DeepSeek-V3's multi-token-prediction layer (61, which its
    definition skips on load) passes; a layer past the config's that the model does not skip is refused."""
    from eagle3pipe.base.errors import UsageError
    from bad_drafts import write_st
    llama = tmp_path / "tied"
    shutil.copytree(families["llama"], llama)
    t = tensors_of(str(llama))
    t["lm_head.weight"] = list(t["model.embed_tokens.weight"])
    write_st(str(llama / "model.safetensors"), t)
    assert "match the LlamaForCausalLM" in _verify(llama)
    for family, layer, ok in (("deepseek_v3", 61, True), ("qwen3", 4, False)):
        folder = tmp_path / f"{family}-{layer}"
        shutil.copytree(families[family], folder)
        t = tensors_of(str(folder))
        t[f"model.layers.{layer}.input_layernorm.weight"] = list(t["model.norm.weight"])
        write_st(str(folder / "model.safetensors"), t)
        if ok:
            assert "match the" in _verify(folder)
        else:
            with pytest.raises(UsageError, match=f"tensor model.layers.{layer}.input_layernorm.weight is not part of"):
                _verify(folder)


def test_a_wrapper_keeps_its_own_tensors_beside_the_language_model(families, tmp_path):
    """A multimodal wrapper (text_config) stores its language model under a prefix of its own and a vision tower
    beside it: the prefix is read from where the embeddings are, the tower is the wrapper's; a tensor lost from the
    language model is still named."""
    from eagle3pipe.base.errors import UsageError
    from bad_drafts import write_st
    src = families["qwen3"]
    wrapper = tmp_path / "wrapper"
    shutil.copytree(src, wrapper)
    with open(wrapper / "config.json") as f:
        text = json.load(f)
    (wrapper / "config.json").write_text(json.dumps({"architectures": ["Qwen3VLLikeForConditionalGeneration"],
                                                     "model_type": "wrapper_like", "text_config": text}))
    t = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
         for k, v in tensors_of(src).items()}
    t["model.visual.patch_embed.weight"] = ["BF16", [4, 4], bytes(32)]
    write_st(str(wrapper / "model.safetensors"), t)
    assert "(under 'model.language_model.')" in _verify(wrapper)
    lost = tmp_path / "lost"  # another folder: a process checks a verifier once
    shutil.copytree(wrapper, lost, ignore=shutil.ignore_patterns("model.safetensors"))
    t.pop("model.language_model.layers.2.mlp.up_proj.weight")
    write_st(str(lost / "model.safetensors"), t)
    with pytest.raises(UsageError, match=r"no tensor model\.language_model\.layers\.2\.mlp\.up_proj\.weight "):
        _verify(lost)


@pytest.fixture(scope="module")
def missing_one(model_path, tmp_path_factory):
    """The embedded SmolLM2 with one decoder weight dropped, and stages 01 and 03 made with it (they read only its
    tokenizer): what a copy that lost a tensor, or a shard, looks like to every later stage."""
    from bad_drafts import write_st
    root = tmp_path_factory.mktemp("missing_one")
    model = root / "verifier"
    shutil.copytree(model_path, model, ignore=shutil.ignore_patterns("model.safetensors"))
    t = tensors_of(model_path)
    t.pop("model.layers.7.self_attn.k_proj.weight")
    write_st(str(model / "model.safetensors"), t)
    d = {"model": str(model), "prepared": root / "prepared", "vocab": root / "vocab"}
    for argv in (["01_prepare_dataset.py", "--model-path", d["model"], "--num-samples", "6", "--max-seq-len", "256",
                  "--output-dir", str(d["prepared"])],
                 ["03_build_vocab_mapping.py", "--prepared-data", str(d["prepared"]), "--draft-vocab-size", "512",
                  "--output-dir", str(d["vocab"])]):
        p, _ = run_script(*argv)
        assert p.returncode == 0, p.stderr[-2000:]
    return d


def _refused_before_load(p, out):
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]  # stage 01 says what it read first
    errors = [line for line in lines if line.startswith("error:")]
    assert p.returncode == 2 and errors == lines[-1:] and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "no tensor model.layers.7.self_attn.k_proj.weight [192, 576] in model.safetensors (1 of the" in lines[-1]
    assert "vllm" not in p.heavy and "speculators" not in p.heavy, p.heavy  # no engine, no trainer
    assert not os.path.exists(out), os.listdir(out)  # nothing taken


def test_every_stage_that_loads_the_verifier_refuses_a_missing_tensor_before_it_loads(missing_one, trained,
                                                                                      tmp_path):
    d, m = missing_one, missing_one["model"]
    out = tmp_path / "out"
    p, _ = run_script("02_extract_hidden_states.py", "--model-path", m, "--prepared-data", str(d["prepared"]),
                      "--output-dir", str(out), "--max-seq-len", "256", "--dry-run")
    _refused_before_load(p, out)
    p, _ = run_script("04_train.py", "--online", "--backend", "hf", "--model-path", m, "--prepared-data",
                      str(d["prepared"]), "--vocab-mapping", str(d["vocab"]), "--output-dir", str(out),
                      "--total-seq-len", "512", "--measure-prompts", "0")
    _refused_before_load(p, out)
    # a draft taken home without its run's manifest (which would name the verifier it trained for: refused first)
    draft = tmp_path / "draft"
    shutil.copytree(os.path.realpath(trained[0] / "last"), draft)
    p, _ = run_script("05_evaluate.py", "--model-path", m, "--prepared-data", str(d["prepared"]), "--draft",
                      str(draft), "--num-prompts", "2", "--output-dir", str(out), "--dry-run")
    _refused_before_load(p, out)
    p, _ = run_script("01_prepare_dataset.py", "--model-path", m, "--regenerate", "--num-samples", "2",
                      "--max-seq-len", "256", "--regen-max-tokens", "64", "--output-dir", str(out))
    _refused_before_load(p, out)


def test_the_hf_backend_never_runs_a_verifier_filled_at_random(missing_one):
    """Where the check could not run first (a hub id's files come as they load), transformers' own report of what
    it initialised at random stops the stage."""
    from eagle3pipe.engines.backends import HFBackend
    from eagle3pipe.base.errors import UsageError
    with pytest.raises(UsageError, match=r"transformers loaded the verifier with (model\.)?"
                                         r"layers\.7\.self_attn\.k_proj\.weight missing from the checkpoint "
                                         r"\(1 missing, 0 misshapen\), so initialised at random; refused"):
        HFBackend(missing_one["model"], [2, 15, 27, 30], dtype="float32")


def test_configs_no_loader_would_take_are_one_line_before_anything_loads(families, model_path, tmp_path):
    """Found by a held-out probe, each once a traceback after the folder was taken: a config its family's own code
    refuses (pad_token_id past the vocabulary: an assert in the embedding), an fp8 quantization_config beside a
    weight stored as I8 (a matmul of bf16 by int8 at the first forward), a gptq one over weights stored unquantized
    (an ImportError of optimum, or random dequantization); and a model_type transformers does not know with no code
    of its own (stage 02's load: ValueError)."""
    from eagle3pipe.verifier import verifier
    from eagle3pipe.base.errors import UsageError
    from bad_drafts import write_st
    src = families["llama"]

    def variant(name, config=None, tensors=None):
        d = tmp_path / name
        shutil.copytree(src, d)
        with open(d / "config.json") as f:
            cfg = json.load(f)
        (d / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
        if tensors is not None:
            write_st(str(d / "model.safetensors"), tensors(tensors_of(src)))
        return d
    pad = variant("pad", {"pad_token_id": 10 ** 9})
    with pytest.raises(UsageError, match=r"cannot build the llama model its config describes \(AssertionError: "):
        _verify(pad)

    def int8(t):
        k = "model.layers.0.self_attn.q_proj.weight"
        t[k] = ["I8", t[k][1], bytes(len(t[k][2]) // 2)]
        return t
    fp8 = variant("fp8", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, int8)
    with pytest.raises(UsageError, match=r"tensor model\.layers\.0\.self_attn\.q_proj\.weight is stored as I8; the "
                                         r"config's fp8 quantization stores a weight as F8_E4M3"):
        _verify(fp8)
    gptq = variant("gptq", {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}})
    with pytest.raises(UsageError, match=r"quantizes with gptq, and no tensor is stored in its form"):
        _verify(gptq)
    heads = variant("heads", {"num_attention_heads": 5})  # a width of 64: huggingface_hub's validator refuses it
    with pytest.raises(UsageError, match=r"cannot build the llama model its config describes "
                                         r"\(StrictDataclassClassValidationError: .*not a multiple of the number of "
                                         r"attention heads \(5\)"):
        _verify(heads)
    unknown = variant("unknown", {"model_type": "foollama"})
    with pytest.raises(UsageError, match=r"model_type 'foollama' is no family the installed transformers .* knows, "
                                         r"and the model ships no code of its own"):
        verifier.check_remote_code(str(unknown), False)


def _fp8(src, d, block, scale_block=None):
    """A copy of the verifier `src` whose projections are stored as F8_E4M3 (zeros: the check reads headers, the
    runs below refuse before any forward) with F32 scales in blocks of `scale_block` (default: the config's)."""
    from bad_drafts import write_st
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": block, "activation_scheme": "dynamic"}
    (d / "config.json").write_text(json.dumps(cfg))
    t, sb = tensors_of(src), scale_block or block
    for k in [k for k in t if k.endswith("proj.weight")]:
        rows, cols = t[k][1]
        t[k] = ["F8_E4M3", [rows, cols], bytes(rows * cols)]
        grid = [-(-rows // sb[0]), -(-cols // sb[1])]
        t[k[:-len("weight")] + "weight_scale_inv"] = ["F32", grid, bytes(4 * grid[0] * grid[1])]
    write_st(str(d / "model.safetensors"), t)
    return d


def test_an_fp8_verifier_s_scales_and_what_transformers_can_run_of_it_here(families, tmp_path):
    """Found by a held-out probe, each a traceback at load or at the first forward: scales whose grid is not the
    config's blocks; on a CPU, where transformers dequantizes fp8 to bf16 (keeping the norms bf16 too), a float32
    run (a bf16-by-float matmul), and blocks that do not divide a weight (it reads the block from the grid: wrong
    weights or a failed load); and a quantization whose package is not installed (bitsandbytes: an ImportError). Each
    is refused by the plan in one line; the GPU is not refused what runs there."""
    import dataclasses
    import importlib.util
    from eagle3pipe.verifier import quantization
    from eagle3pipe.base.errors import UsageError
    src = families["llama"]  # width 64, MLP 128
    good = quantization.read(str(_fp8(src, tmp_path / "good", [32, 32])))
    assert (good.method, good.uneven) == ("fp8", "")
    assert "match the LlamaForCausalLM" in _verify(tmp_path / "good")
    assert quantization.transformers_refusal(good, False, "bfloat16") is None
    assert quantization.transformers_refusal(good, True, "float32") is None
    assert "it computes in bfloat16 only here; pass --dtype bfloat16" in \
        quantization.transformers_refusal(good, False, "float32")
    # one block spanning a side is exact however the weight divides (transformers reads the block off the grid): the
    # default [128, 128] over a [64, 128] weight, one scale (a held-out probe's false refusal)
    whole = quantization.read(str(_fp8(src, tmp_path / "whole", [128, 128])))
    assert whole.uneven == "" and quantization.transformers_refusal(whole, False, "bfloat16") is None
    uneven = quantization.read(str(_fp8(src, tmp_path / "uneven", [48, 48])))
    assert uneven.uneven.startswith("model.layers.0.") and "in blocks of [48, 48]" in uneven.uneven
    assert "is no whole number of blocks" in quantization.transformers_refusal(uneven, False, "bfloat16")
    assert quantization.transformers_refusal(uneven, True, "bfloat16") is None
    with pytest.raises(UsageError, match=r"model\.safetensors: model\.layers\.0\.\S+\.weight_scale_inv is F32 "
                                         r"\[2, 4\]; the fp8 weight .* \[64, 128\] in blocks of \[16, 16\] needs "
                                         r"\[4, 8\] in floating point"):
        quantization.read(str(_fp8(src, tmp_path / "grid", [16, 16], scale_block=[32, 32])))
    # blocks' scales named weight_scale (AutoFP8's per-tensor name): left unset by both loaders, a traceback at the
    # first forward (a held-out probe); one scale a tensor so named: vLLM reads it, transformers does not
    named = _fp8(src, tmp_path / "named", [32, 32])
    t = tensors_of(named)
    t = {(k[:-len("_inv")] if k.endswith(".weight_scale_inv") else k): v for k, v in t.items()}
    from bad_drafts import write_st
    write_st(str(named / "model.safetensors"), t)
    with pytest.raises(UsageError, match=r"weight_scale: the fp8 weight .* block scales are named weight_scale; "
                                         r"quant_method fp8 reads them as .*\.weight_scale_inv"):
        quantization.read(str(named))
    cfg = json.loads((named / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = None
    (named / "config.json").write_text(json.dumps(cfg))
    t = {k: (["F32", [], bytes(4)] if k.endswith(".weight_scale") else v) for k, v in t.items()}
    write_st(str(named / "model.safetensors"), t)
    per_tensor = quantization.read(str(named))
    assert per_tensor.misnamed.endswith(".weight_scale")
    assert "named weight_scale" in quantization.transformers_refusal(per_tensor, True, "bfloat16")
    if importlib.util.find_spec("bitsandbytes") is None:  # not in requirements.txt: what a machine without it sees
        bnb = dataclasses.replace(good, method="bitsandbytes",
                                  config=json.dumps({"quant_method": "bitsandbytes", "load_in_4bit": True}))
        assert "transformers cannot load its bitsandbytes quantization here (ImportError: " in \
            quantization.transformers_refusal(bnb, False, "bfloat16")
