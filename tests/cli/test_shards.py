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
