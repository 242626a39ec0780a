"""Kimi-K2.5's class through stage 02's vLLM backend on CPU: a small random DeepSeek-V3 (MLA + MoE) extracts like
the HF backend. The default set runs the rest of the class end to end (tests/e2e/test_architectures.py)."""
import json

from conftest import run_script


def test_vllm_backend_extracts_an_mla_moe_verifier_like_the_hf_backend(ds):
    import torch
    from safetensors.torch import load_file
    out = ds["root"] / "hs_vllm"
    p, _ = run_script("02_extract_hidden_states.py", "--model-path", ds["model"], "--prepared-data", str(ds["prep"]),
                      "--output-dir", str(out), "--max-seq-len", "256", "--batch-size", "8")
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.load(open(out / "manifest.json"))
    assert m["layer_ids"] == [2, 4, 5, 8] and m["complete"]
    worst = []
    for i in range(m["counts"]["rows"]):
        a, b = load_file(out / f"hs_{i}.safetensors"), load_file(ds["hf"] / f"hs_{i}.safetensors")
        assert torch.equal(a["token_ids"], b["token_ids"])
        ha, hb = a["hidden_states"].float(), b["hidden_states"].float()
        worst.append(max(((ha[:, k] - hb[:, k]).norm() / hb[:, k].norm()).item() for k in range(4)))
    # bf16 through MLA and top-2 routing: the worst stored layer of a row agreed within 1.1-1.5 % (2026-12-02, with
    # vLLM's pure-torch rope on this CPU: adapters.VLLM_CPU_MLA_COMPILATION)
    assert max(worst) < 0.03, worst
