"""Stage 02's data-parallel replicas on CPU: two `--shard` processes into one folder give the same files as one
run, the replica that finishes last writes the manifest, `--verify` names a corrupt or missing file and the shard
that owns it, and an fp8 run trains (scripts/extract.sh with two replicas: tests/slow/test_launcher.py)."""
import json
import os
import subprocess

from safetensors.torch import load_file
import torch

from conftest import REPO, extract, rows_of, run_script


def test_two_shards_as_two_processes_equal_one_run(prep, hf_out, model_path, tmp_path):
    out = tmp_path / "hs"
    procs = [subprocess.Popen([os.sys.executable, "02_extract_hidden_states.py", "--backend", "hf", "--model-path",
                               model_path, "--prepared-data", str(prep), "--output-dir", str(out), "--max-seq-len",
                               "256", "--shard", f"{k}/2"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in range(2)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert sum("the manifest is written when all 2 shards are" in e for e in errs) <= 1
    m = json.load(open(out / "manifest.json"))
    rows = rows_of(prep)
    assert m["complete"] and m["counts"]["ok"] == len(rows) and m["counts"]["shards"] == 2
    for i in range(len(rows)):
        a, b = load_file(out / f"hs_{i}.safetensors"), load_file(hf_out / f"hs_{i}.safetensors")
        assert torch.equal(a["token_ids"], b["token_ids"])
        # other batch shapes (the rows are batched within each shard), so bf16 on CPU rounds differently: per state,
        # as close as the vLLM and HF backends are to each other (on an H200 the files were bit-identical)
        x, y = a["hidden_states"].float(), b["hidden_states"].float()
        assert ((x - y).norm(dim=(0, 2)) / y.norm(dim=(0, 2)) < 0.03).all(), i
    for k in range(2):  # each replica took exactly its rows
        rep = json.load(open(out / f".shard-{k}-of-2.json"))
        assert rep["tokens"] == sum(len(r["input_ids"]) for i, r in enumerate(rows) if i % 2 == k)

    # --verify: loads no model, names the corrupt file and the shard to rerun
    path = out / "hs_3.safetensors"
    data = bytearray(path.read_bytes())
    data[-64] ^= 0x10
    path.write_bytes(bytes(data))
    (out / "hs_5.safetensors").unlink()
    p, secs = extract(model_path, prep, out, "--backend", "hf", "--verify")
    assert p.returncode == 1 and "vllm" not in p.heavy and "transformers" not in p.heavy, p.heavy  # no model
    assert "2 rows have no valid file" in p.stderr and "hs_3.safetensors" in p.stderr, p.stderr
    assert "checksum mismatch" in p.stderr and "rerun shard(s) 1/2" in p.stderr, p.stderr
    p, _ = extract(model_path, prep, out, "--backend", "hf", "--shard", "1/3")  # every replica splits the same way
    # the folder holds a finished run's manifest: refused as a finished run of another split, before it is taken
    assert p.returncode == 2 and "split 2 ways" in p.stderr and "give --shard I/2" in p.stderr and not p.heavy, p.stderr
    p, _ = extract(model_path, prep, out, "--backend", "hf", "--shard", "1/2")  # redoes exactly those two
    assert p.returncode == 0 and "2 to go" in p.stderr, p.stderr
    assert json.load(open(out / "manifest.json"))["complete"]


def test_fp8_storage_halves_the_disk_and_trains(prep, hf_out, model_path, tmp_path):
    out = tmp_path / "fp8"
    # three writer threads on CPU (default one): the files are the same whichever thread writes them
    p, _ = extract(model_path, prep, out, "--backend", "hf", "--storage-dtype", "fp8", "--writer-threads", "3")
    assert p.returncode == 0, p.stderr
    m, m16 = json.load(open(out / "manifest.json")), json.load(open(hf_out / "manifest.json"))
    assert m["storage_dtype"] == "fp8" and m["counts"]["bytes"] < 0.6 * m16["counts"]["bytes"]
    f = load_file(out / "hs_0.safetensors")
    assert f["hidden_states"].dtype == torch.float8_e4m3fn and f["hidden_states_scales"].shape[1:] == (1, 1)
    # the largest scale it wrote, on record: stage 04 holds every file to it
    assert 0 < float(f["hidden_states_scales"].max()) <= m["fp8_scale_max"]
    # the same folder cannot silently mix: a bf16 rerun into it is another run
    p, _ = extract(model_path, prep, out, "--backend", "hf")
    assert p.returncode == 2 and "storage_dtype differs" in p.stderr
    p, _ = run_script("03_build_vocab_mapping.py", "--prepared-data", str(prep), "--draft-vocab-size", "512",
                      "--output-dir", str(tmp_path / "vocab"))
    assert p.returncode == 0, p.stderr
    p, _ = run_script("04_train.py", "--model-path", model_path, "--prepared-data", str(prep), "--hidden-states",
                      str(out), "--vocab-mapping", str(tmp_path / "vocab"), "--output-dir", str(tmp_path / "ck"),
                      "--max-steps", "3", "--epochs", "50", "--total-seq-len", "512",
                      "--num-workers", "1")  # a worker hands on fp8 bytes (fp8_transport.ByteDataset)
    assert p.returncode == 0, p.stderr
    assert "fork server is not used" not in p.stderr  # the worker forked from stage 04's warm server
    man = json.load(open(tmp_path / "ck" / "manifest.json"))
    assert man["steps"] == 3 and man["speculators_config"]["hidden_states_backend"] == "eagle3pipe-checked"
    # --max-steps ends the run: no empty epochs, each with its own checkpoint and validation, after it
    assert len([n for n in os.listdir(tmp_path / "ck") if n.isdigit()]) <= 3
