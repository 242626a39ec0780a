"""Verifier families no stage was written for, refused in one line before anything loads where the installed
libraries cannot take them: vLLM with no EAGLE-3 support for the architecture (Gemma2: its engine died after loading
the verifier, in stage 02's vLLM backend and stage 05 alike), and a rope speculators cannot give a draft (Phi-4-mini's
longrope over a partial rotary: speculators failed after the data was read). Random tiny verifiers (tests/verifiers.py).
"""
import json

import pytest

from conftest import loaded_nothing, run_script
import verifiers


def refused(p, *needles):
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-2000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert loaded_nothing(p), f"refused only after importing {p.heavy}"


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, model_path):
    out = tmp_path_factory.mktemp("gemma2")
    model = verifiers.dense(str(out / "model"), model_path, "Gemma2Config", head_dim=16)
    conv = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]}
    (out / "d.jsonl").write_text(json.dumps(conv) + "\n")
    p, _ = run_script("01_prepare_dataset.py", "--model-path", model, "--dataset", str(out / "d.jsonl"),
                      "--output-dir", str(out / "prep"))
    assert p.returncode == 0, p.stderr[-2000:]
    return out, model


def test_an_architecture_vllm_has_no_eagle3_for_is_refused_before_anything_loads(gemma2):
    out, model = gemma2
    for dry in ([], ["--dry-run"]):
        p, _ = run_script("02_extract_hidden_states.py", "--model-path", model, "--prepared-data", str(out / "prep"),
                          "--output-dir", str(out / "hs"), "--backend", "vllm", *dry)
        refused(p, "--backend vllm: the installed vLLM", "no EAGLE-3 support for Gemma2ForCausalLM",
                "use --backend hf")
        assert not (out / "hs").exists()
        p, _ = run_script("05_evaluate.py", "--model-path", model, "--draft", str(out / "no-draft-needed"),
                          "--prepared-data", str(out / "prep"), "--output-dir", str(out / "eval"), "--vllm", "on", *dry)
        refused(p, f"--model-path {model}: the installed vLLM", "no EAGLE-3 support for Gemma2ForCausalLM",
                "--vllm on")
        assert not (out / "eval").exists()
    # the HF backend takes it: its plan passes
    p, _ = run_script("02_extract_hidden_states.py", "--model-path", model, "--prepared-data", str(out / "prep"),
                      "--output-dir", str(out / "hs"), "--backend", "hf", "--dry-run")
    assert p.returncode == 0, p.stderr[-2000:]


def test_a_rope_speculators_cannot_give_a_draft_is_refused_before_the_data_is_read(tmp_path, model_path):
    factors = [1.0] * 6  # for a rotary part of 0.75 of 16-wide heads; the draft's rope covers all 16: 8 a list
    model = verifiers.dense(str(tmp_path / "phi4mini"), model_path, "Phi3Config", partial_rotary_factor=0.75,
                            original_max_position_embeddings=1024,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": factors,
                                             "long_factor": factors, "partial_rotary_factor": 0.75,
                                             "original_max_position_embeddings": 1024})
    p, _ = run_script("04_train.py", "--model-path", model, "--prepared-data", str(tmp_path / "not-read"),
                      "--hidden-states", str(tmp_path / "not-read-either"), "--vocab-mapping", str(tmp_path / "nor"),
                      "--output-dir", str(tmp_path / "out"))
    refused(p, f"--model-path {model}: speculators cannot build this verifier's draft", "6 long_factor entries",
            "8 entries a list")
    assert not (tmp_path / "out").exists()


def test_a_verifier_too_shallow_for_the_default_layer_ids_is_told_which_flag_to_give(tmp_path, model_path):
    model = verifiers.dense(str(tmp_path / "four"), model_path, "Qwen3Config", layers=4)
    p, _ = run_script("04_train.py", "--model-path", model, "--online", "--prepared-data", str(tmp_path / "x"),
                      "--vocab-mapping", str(tmp_path / "y"), "--output-dir", str(tmp_path / "out"))
    refused(p, "--layer-ids: the default auxiliary ids [2, n//2, n-3] = [2, 2, 1] do not fit a 4-layer verifier",
            "give --layer-ids, e.g. 1,2,3")
