"""Stage 02's --shard flag: its refusals."""


from conftest import assert_refused, run_script


def test_shard_flag_refusals(prep, model_path, tmp_path):
    base = ["02_extract_hidden_states.py", "--model-path", model_path, "--prepared-data", str(prep),
            "--output-dir", str(tmp_path / "hs")]
    for extra, words in (
            (["--shard", "2/2"], ["--shard", "0 <= I < N"]),
            (["--shard", "one"], ["--shard", "I/N"]),
            (["--shard", "0/2", "--overwrite"], ["--overwrite with --shard"]),
            (["--shard", "0/2", "--verify"], ["--verify", "drop --shard"]),
            (["--writer-threads", "0"], ["--writer-threads 0", "at least 1"])):
        assert_refused(*run_script(*base, *extra), *words)
    assert not (tmp_path / "hs").exists()


def test_a_replica_of_another_split_is_refused_on_a_finished_folder(stages, model_path):
    """A finished unsharded folder given to `--shard 0/2` had its manifest taken away (until a second replica ran):
    a complete output made incomplete by a changed flag. Refused before the folder is taken, the manifest kept."""
    hs, manifest = stages["hs"], stages["hs"] / "manifest.json"
    before = manifest.read_bytes()
    argv = ["02_extract_hidden_states.py", "--model-path", model_path, "--prepared-data", str(stages["prepared"]),
            "--output-dir", str(hs), "--max-seq-len", "512", "--backend", "hf", "--shard", "0/2"]
    assert_refused(*run_script(*argv), f"--shard 0/2: {hs} holds a finished run split 1 way", "drop --shard")
    assert manifest.read_bytes() == before
