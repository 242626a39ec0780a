"""Stage 01 --regenerate through transformers (`--regen-engine hf`): for a training cluster without the serving
engine. Resumed after a kill from the answers already written, as through vLLM (tests/slow/test_regenerate.py, where
the two engines' greedy answers are compared); several sampled answers a conversation, each a row, none twice."""
import json
import os
import signal
import subprocess
import sys

from conftest import REPO, regen_records, run_script


def test_regenerate_through_transformers_resumes_after_a_kill(model_path, tokenizer, tmp_path):
    data, out = regen_records(tmp_path / "d.jsonl"), tmp_path / "prep"
    argv = ["01_prepare_dataset.py", "--model-path", model_path, "--dataset", str(data), "--output-dir", str(out),
            "--max-seq-len", "256", "--regenerate", "--regen-engine", "hf", "--regen-max-tokens", "12",
            "--regen-batch-size", "2"]
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=log, stderr=log, start_new_session=True,
                            env=dict(os.environ, EAGLE3_INJECT_KILL="regen:2"))  # SIGKILL after the second batch
    assert proc.wait(timeout=600) == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-2000:]
    cache = out / ".regenerating.jsonl"
    assert len(cache.read_text().splitlines()) == 4 and not (out / "manifest.json").exists()
    p, _ = run_script(*argv)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--regenerate through hf" in p.stderr and "regenerated 5 assistant turns (4 from an earlier run)" in p.stderr
    m = json.load(open(out / "manifest.json"))["regenerated"]
    assert (m["turns_regenerated"], m["turns_from_cache"], m["opening_turns_dropped"]) == (5, 4, 1)
    assert m["settings"]["engine"] == "hf"
    rows = [json.loads(line) for line in open(out / "tokenized_data.jsonl")]
    texts = [tokenizer.decode([t for t, k in zip(r["input_ids"], r["loss_mask"]) if k]) for r in rows]
    assert len(rows) == 5 and not any("ORIGINAL" in t for t in texts) and all(t.strip() for t in texts)


def test_what_transformers_cannot_run_is_refused_before_the_folder_is_taken(model_path, tmp_path):
    """Found by a held-out probe, each an exit 1 after the folder was taken: a verifier folder without weights (the
    HF loader's OSError), a quantization whose package is not installed (bitsandbytes: an ImportError)."""
    import json
    from conftest import verifier_files
    data = regen_records(tmp_path / "d.jsonl", n=1)
    bare = verifier_files(model_path, tmp_path / "bare")
    bnb = verifier_files(model_path, tmp_path / "bnb")
    os.link(os.path.join(model_path, "model.safetensors"), bnb / "model.safetensors")
    cfg = json.loads((bnb / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (bnb / "config.json").write_text(json.dumps(cfg))
    for model, says in ((bare, "no weight files (*.safetensors, *.bin)"),
                        (bnb, "--regen-engine hf, compute dtype ")):
        out = tmp_path / f"out-{model.name}"
        p, _ = run_script("01_prepare_dataset.py", "--model-path", str(model), "--dataset", str(data), "--output-dir",
                          str(out), "--max-seq-len", "256", "--regenerate", "--regen-engine", "hf",
                          "--regen-max-tokens", "8")
        lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert p.returncode == 2 and len(lines) == 1 and says in lines[0] and not out.exists(), p.stderr[-2000:]
    assert "bitsandbytes" in lines[0]
