"""A family other than the embedded Llama, end to end: a random Qwen3 (its q/k norms, its own head size) through
stages 01 to 05 with both extraction backends, the same states from each; stage 04's targets check passes on its
own (speculators' Llama-style norm is Qwen3's); stage 05 through vLLM where the installed vLLM serves the family,
with the measure beside it (Gemma 3, which it does not serve: tests/slow/test_gemma_targets.py, the measure alone)."""
import json

import torch
from safetensors.torch import load_file

from conftest import run_script
from verifiers import dense


def test_qwen3_from_chats_to_a_measured_draft_through_both_backends(model_path, tmp_path):
    from eagle3pipe.verifier import vllm_support
    model = dense(str(tmp_path / "qwen3"), model_path, "Qwen3Config", hidden=128, heads=4, head_dim=32)
    d = {k: tmp_path / k for k in ("prepared", "hs", "hs_vllm", "vocab", "ckpt", "ev")}
    steps = [
        ["01_prepare_dataset.py", "--model-path", model, "--num-samples", "24", "--max-seq-len", "256",
         "--output-dir", str(d["prepared"])],
        ["02_extract_hidden_states.py", "--backend", "hf", "--model-path", model, "--prepared-data",
         str(d["prepared"]), "--output-dir", str(d["hs"]), "--max-seq-len", "256", "--dtype", "float32"],
        ["02_extract_hidden_states.py", "--backend", "vllm", "--model-path", model, "--prepared-data",
         str(d["prepared"]), "--output-dir", str(d["hs_vllm"]), "--max-seq-len", "256", "--dtype", "float32"],
        ["03_build_vocab_mapping.py", "--prepared-data", str(d["prepared"]), "--draft-vocab-size", "1024",
         "--output-dir", str(d["vocab"])],
        ["04_train.py", "--model-path", model, "--prepared-data", str(d["prepared"]), "--hidden-states", str(d["hs"]),
         "--vocab-mapping", str(d["vocab"]), "--output-dir", str(d["ckpt"]), "--total-seq-len", "512",
         "--epochs", "2", "--measure-prompts", "0"],
        ["05_evaluate.py", "--model-path", model, "--draft", str(d["ckpt"] / "last"), "--prepared-data",
         str(d["prepared"]), "--num-prompts", "3", "--max-new-tokens", "24", "--batch-sizes", "1", "--dtype",
         "float32", "--measure", "on", "--output-dir", str(d["ev"])],
    ]
    for argv in steps:
        p, _ = run_script(*argv)
        assert p.returncode == 0, (argv[0], p.stderr[-3000:])
        if argv[0] == "04_train.py":
            assert "training targets equal the verifier's own next-token distribution" in p.stderr \
                and "as speculators computes them" in p.stderr, p.stderr[-2000:]  # Qwen3's norm is speculators' own
    # the two backends' states agree (float32 both; the engines' kernels differ in the last bits)
    a, b = load_file(str(d["hs"] / "hs_0.safetensors")), load_file(str(d["hs_vllm"] / "hs_0.safetensors"))
    assert torch.equal(a["token_ids"], b["token_ids"])
    x, y = a["hidden_states"].float(), b["hidden_states"].float()
    assert x.shape == y.shape and (x - y).abs().max() <= 1e-2 * x.abs().max(), (x - y).abs().max()
    rep = json.load(open(d["ev"] / "report.json"))
    if vllm_support.eagle3_refusal("Qwen3ForCausalLM") is None:
        assert rep["engine"] == "vllm" and rep["speculative"]["1"]["drafts"] > 0, rep
        ours = rep["measure_vs_vllm"]
        assert abs(ours["acceptance_length"] - ours["vllm"]) <= 0.05, ours
    else:
        assert rep["engine"] == "measure", rep
