"""The INT4 verifier (tests/verifiers.py, conftest's `int4`) through stages 02-05: the HF backend's states equal the
dequantized model's bit for bit, a Llama-style and an MLA draft train from them, stage 05 refuses it on this CPU.
The default set keeps the INT4 checks that load nothing (tests/e2e/test_int4.py)."""
import json

from conftest import assert_refused, extract, run_script


def test_hf_states_equal_the_dequantized_model_s_and_a_draft_trains_but_stage05_refuses(int4, tmp_path):
    """bf16 on both sides: transformers decompresses the packed experts into the very bf16 weights compressed-tensors'
    dequantizer writes, so the states are equal bit for bit (in float32 the INT4 model's experts are decompressed in
    float32, the reference's were rounded to bf16: no longer the same weights)."""
    from safetensors.torch import load_file
    a, b = tmp_path / "hs", tmp_path / "hs_ref"
    for model, prep, out in ((int4["model"], int4["prep"], a), (int4["reference"], int4["prep_ref"], b)):
        p, _ = extract(model, prep, out, "--trust-remote-code", "--backend", "hf", "--dtype", "bfloat16")
        assert p.returncode == 0, p.stderr[-3000:]
    rows = json.load(open(a / "manifest.json"))["counts"]["rows"]
    assert rows >= 3
    for i in range(rows):
        x, y = load_file(str(a / f"hs_{i}.safetensors")), load_file(str(b / f"hs_{i}.safetensors"))
        assert x["hidden_states"].equal(y["hidden_states"]), i
    # stage 04 copies the draft's embedding and head from the INT4 checkpoint, where they stay bf16
    vocab, ckpt = tmp_path / "vocab", tmp_path / "ckpt"
    p, _ = run_script("03_build_vocab_mapping.py", "--prepared-data", str(int4["prep"]), "--draft-vocab-size", "1024",
                      "--output-dir", str(vocab))
    assert p.returncode == 0, p.stderr[-2000:]
    p, _ = run_script("04_train.py", "--model-path", int4["model"], "--prepared-data", str(int4["prep"]),
                      "--hidden-states", str(a), "--vocab-mapping", str(vocab), "--output-dir", str(ckpt), "--epochs",
                      "1", "--total-seq-len", "512", "--draft-arch", "llama", "--measure-prompts", "0",
                      "--trust-remote-code")
    assert p.returncode == 0 and (ckpt / "last" / "model.safetensors").is_file(), p.stderr[-3000:]
    # and the MLA draft (`auto` for this verifier), its embedding copied from the same bf16 tensor
    p, _ = run_script("04_train.py", "--model-path", int4["model"], "--prepared-data", str(int4["prep"]),
                      "--hidden-states", str(a), "--vocab-mapping", str(vocab), "--output-dir", str(tmp_path / "mla"),
                      "--epochs", "1", "--total-seq-len", "512", "--fc-norm", "--measure-prompts", "0",
                      "--trust-remote-code")
    assert p.returncode == 0 and "deepseek" in json.load(open(tmp_path / "mla" / "manifest.json"))["recipe"][
        "draft_arch"], p.stderr[-3000:]
    out = tmp_path / "eval"
    assert_refused(*run_script("05_evaluate.py", "--model-path", int4["model"], "--draft", str(ckpt / "last"),
                               "--prepared-data", str(int4["prep"]), "--output-dir", str(out), "--num-prompts", "2",
                               "--trust-remote-code"),
                   "the verifier is int4 compressed-tensors", "run stage 05 on a GPU machine")
    assert not out.exists()
