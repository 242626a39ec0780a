"""Kimi-K2.5's architecture class end to end on CPU: a small random DeepSeek-V3 (MLA with DeepSeek's real widths, a
mixture of experts with `noaux_tc` routing) through stages 01, 03, 04 and 05 with a Llama-style draft and with the MLA
draft (stage 02's vLLM backend on it: tests/slow/test_architectures.py), and the multimodal wrapper shape whose
language model sits under `text_config`. Built inside the test from transformers' own config; the tokenizer is
SmolLM2's."""
from conftest import run_script
from verifiers import wrapped_text_config



def test_wrapper_config_is_read_from_its_text_config(ds, tmp_path):
    wrapper = wrapped_text_config(str(tmp_path / "kimi_like"), ds["model"])
    from eagle3pipe.verifier import verifier
    fp = verifier.fingerprint(wrapper)
    assert (fp["num_hidden_layers"], fp["hidden_size"], fp["vocab_size"]) == (8, 256, 49152)
    assert fp["architecture"] == "KimiK25ForConditionalGeneration"
    prep = tmp_path / "prep"
    p, _ = run_script("01_prepare_dataset.py", "--model-path", wrapper, "--num-samples", "4", "--max-seq-len", "256",
                      "--output-dir", str(prep))
    assert p.returncode == 0, p.stderr[-3000:]
    p, secs = run_script("02_extract_hidden_states.py", "--model-path", wrapper, "--prepared-data", str(prep),
                         "--output-dir", str(tmp_path / "hs"), "--max-seq-len", "256", "--dry-run")
    assert p.returncode == 0 and "layer ids: [2, 4, 5, 8]" in p.stdout, p.stderr[-2000:]
    assert "match the DeepseekV3ForCausalLM its config defines (" not in p.stdout, p.stdout  # text model's names
    assert "vllm" not in p.heavy and "speculators" not in p.heavy, p.heavy  # no engine (the weights check: torch)
    # the draft's shape, as speculators builds it from the wrapper: the text model's width and heads
    from speculators.train.cli import create_transformer_layer_config
    cfg = create_transformer_layer_config(wrapper, 1, "llama", None, 0, [])
    assert cfg.hidden_size == 256 and cfg.num_attention_heads == 4 and cfg.vocab_size == 49152
