"""Stage 02 through its command line, before any model loads: preflight refusals (exit 2, one line, nothing heavy
imported), a batch too large for the memory, and the dry run's plan."""
import json
import os


from conftest import assert_refused, extract, loaded_nothing, run_script


def test_preflight_refusals(prep, model_path, tmp_path):
    other = tmp_path / "other-model"  # the same files but another hidden size: another verifier
    other.mkdir()
    for name in os.listdir(model_path):
        if name != "config.json":
            os.symlink(os.path.join(model_path, name), other / name)
    cfg = json.load(open(os.path.join(model_path, "config.json")))
    cfg["hidden_size"] = 640
    json.dump(cfg, open(other / "config.json", "w"))
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / ".eagle3-owner.jsonl").write_text('{"stage": "vocab", "version": 2}\n')
    out = str(tmp_path / "hs")
    cases = [
        (["--data-path", str(prep)], ["unknown flag --data-path", "did you mean --prepared-data"]),
        (["--layer-ids", "2,15,40"], ["--layer-ids [40]", "[0, 29]"]),
        (["--layer-ids", "2,2,27"], ["distinct"]),
        (["--layer-ids", "30,30"], ["--layer-ids [30, 30]: ids must be distinct"]),
        (["--layer-ids", "2,30,15"], ["id 30 (the last layer, always stored) goes last"]),
        (["--layer-ids", "27,2,15"], ["--layer-ids [27, 2, 15]: give the ids in ascending order (2,15,27)"]),
        (["--layer-ids", ",,,"], ["--layer-ids", "expected integers separated by commas"]),
        # a list starting with a minus was taken for a flag by argparse: "expected one argument"
        (["--layer-ids", "-1,15,27"], ["--layer-ids [-1, 15, 27]: must be at least 0"]),
        (["--verify", "--overwrite"], ["--verify with --overwrite", "drop one"]),
        # verifying a folder no run wrote took it (lock, record) and failed on every row, exit 1
        (["--verify", "--backend", "hf"], [f"--output-dir {out}: no extraction to verify here"]),
        (["--tp-size", "3"], ["--tp-size 3", "no GPU visible"]),
        (["--tp-size", "4"], ["--tp-size 4", "must divide", "num_attention_heads (9)"]),
        (["--batch-size", "0"], ["--batch-size 0"]),
        (["--max-seq-len", "100"], ["--max-seq-len 100", "rerun 01_prepare_dataset.py"]),
        (["--max-seq-len", "9000"], ["--max-seq-len 9000", "8192 positions"]),
        (["--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization 1.5"]),
        (["--prepared-data", str(tmp_path / "nope")], ["run 01_prepare_dataset.py first"]),
        (["--model-path", str(other)], ["another verifier", "hidden_size", "rerun 01_prepare_dataset.py"]),
        (["--output-dir", str(tmp_path / "v")], ["holds the output of stage 'vocab'"]),
        (["--backend", "tgi"], ["--backend", "invalid choice"]),
        (["--backend", "hf", "--tp-size", "8"], ["--tp-size 8", "hf backend has no tensor parallelism"]),
    ]
    for argv, needles in cases:
        base = ["--model-path", model_path, "--prepared-data", str(prep), "--output-dir", out, "--max-seq-len", "256"]
        p, secs = run_script("02_extract_hidden_states.py", *base, *argv)
        assert_refused(p, secs, *needles)
    assert not os.path.exists(out)


def test_huge_batch_is_refused_or_explained(model_path, tmp_path):
    """The original incident: --batch-size 2000 taken as 'all samples' on 300 ShareGPT conversations at 2,048
    tokens. Refused before the model loads, with the largest batch size that fits and the misunderstanding."""
    prep = tmp_path / "p300"
    p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "300",
                      "--output-dir", str(prep))
    assert p.returncode == 0, p.stderr
    p, secs = run_script("02_extract_hidden_states.py", "--model-path", model_path, "--prepared-data", str(prep),
                         "--output-dir", str(tmp_path / "hs"), "--batch-size", "2000", "--max-seq-len", "2048",
                         "--dry-run")
    if p.returncode == 2:
        assert_refused(p, secs, "--batch-size 2000", "the largest --batch-size that fits is",
                       "not the number of samples to extract")
    else:  # a machine with enough memory: the dry run passes and explains the flag
        assert p.returncode == 0 and "not the number of samples to extract" in p.stderr
    assert not (tmp_path / "hs").exists()


def test_dry_run_prints_the_plan_and_loads_no_model(prep, model_path, tmp_path):
    from eagle3pipe.base import compute
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}  # a user's cache with no verifier definition kept yet
    p, secs = extract(model_path, prep, tmp_path / "hs", "--dry-run", env=cache)
    assert p.returncode == 0, p.stderr
    assert "layer ids: [2, 15, 27, 30]" in p.stdout and "disk:" in p.stdout and "memory:" in p.stdout
    # the weights against the model the config defines: transformers builds it on the meta device (no engine, no
    # weight read), the last check before the folder would be taken
    assert "  weights: 272 tensors (0.25 GiB) match the LlamaForCausalLM its config defines\n" in p.stdout, p.stdout
    assert "vllm" not in p.heavy and "speculators" not in p.heavy and not (tmp_path / "hs").exists(), p.heavy
    # the definition is kept: the next dry run checks the same weights without importing anything heavy
    assert len(os.listdir(tmp_path / "cache" / "eagle3pipe" / "definitions")) == 1
    p, _ = extract(model_path, prep, tmp_path / "hs", "--dry-run", env=cache)
    assert p.returncode == 0 and "  weights: 272 tensors (0.25 GiB) match" in p.stdout and loaded_nothing(p), p.heavy
    # the compute dtype and its reason, before anything loads: what auto picks on this machine, or what was asked
    assert f"  {compute.resolve('auto', on_gpu=False).describe()}\n" in p.stdout
    p, _ = extract(model_path, prep, tmp_path / "hs", "--dry-run", "--dtype", "float32")
    assert p.returncode == 0 and "compute dtype: float32 (--dtype float32" in p.stdout
    weights = [l for l in p.stdout.splitlines() if "memory: weights" in l][0]
    assert "weights 0.50 GiB" in weights  # the bf16 checkpoint (0.25 GiB) counts twice in float32


def test_the_last_layer_among_the_ids_is_named_in_a_warning(prep, model_path, tmp_path):
    """`--layer-ids 2,15,30` on 30 layers reads 30 as the last layer (stored anyway): two auxiliary layers, not the
    three the operator likely meant. Accepted, with a warning saying so, before anything loads."""
    p, _ = extract(model_path, prep, tmp_path / "hs", "--dry-run", "--layer-ids", "2,15,30")
    assert p.returncode == 0, p.stderr
    assert "layer ids: [2, 15, 30]" in p.stdout
    assert "--layer-ids 2,15,30: id 30 is the 30-layer verifier's last layer" in p.stderr
    assert "the draft gets 2 auxiliary layer(s), [2, 15] (EAGLE-3 takes 3, e.g. 2,15,27)" in p.stderr
    p, _ = extract(model_path, prep, tmp_path / "hs", "--dry-run", "--layer-ids", "2,15,27,30")
    assert p.returncode == 0 and "last layer" not in p.stderr  # the three and the last, as stored: no warning


def test_the_dry_run_reads_the_rows_and_a_count_below_zero_is_refused(prep, model_path, tmp_path):
    """--dry-run checks what the run checks first, the rows included: a malformed row (stage 01's manifest still
    vouches for the file) is named by the dry run, not by the run after the verifier loaded. A manifest whose counts
    were edited below 0 (the plan said "-3 samples") is refused naming the field."""
    import shutil
    data = tmp_path / "prepared"
    shutil.copytree(prep, data)
    rows = (data / "tokenized_data.jsonl").read_text().splitlines(keepends=True)
    rows[2] = '{"input_ids": [1, 2], "loss_mask": [1]}\n'
    (data / "tokenized_data.jsonl").write_text("".join(rows))
    assert_refused(*extract(model_path, data, tmp_path / "hs", "--dry-run"), "tokenized_data.jsonl:3: malformed row")
    shutil.rmtree(data)
    shutil.copytree(prep, data)
    man = json.loads((data / "manifest.json").read_text())
    man["counts"]["rows"] = -3
    (data / "manifest.json").write_text(json.dumps(man))
    assert_refused(*extract(model_path, data, tmp_path / "hs", "--dry-run"), "manifest.json: field 'rows' is -3, a "
                                                                            "count below 0; rerun 01_prepare_dataset.py")
    assert not (tmp_path / "hs").exists()
