"""Stage 04 through its command line: cross-stage refusals before anything heavy."""
import shutil


from conftest import assert_refused, run_script, train_args


def test_cross_stage_refusals(stages, model_path, tmp_path):
    other = tmp_path / "prep2"
    p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "5", "--max-seq-len", "512",
                      "--output-dir", str(other))
    assert p.returncode == 0
    bad_hs = tmp_path / "hs_bad"
    shutil.copytree(stages["hs"], bad_hs)
    f = bad_hs / "hs_3.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    bad_vocab = tmp_path / "vocab_bad"
    shutil.copytree(stages["vocab"], bad_vocab)
    import numpy as np
    np.save(bad_vocab / "d2t.npy", np.zeros(100, dtype=np.int64))
    out = tmp_path / "out"
    cases = [
        (["--hidden-states", str(tmp_path / "none")], ["--hidden-states", "run 02_extract_hidden_states.py first"]),
        (["--prepared-data", str(other)], ["extracted from another stage 01 run", "rerun 02_extract_hidden_states.py"]),
        (["--hidden-states", str(bad_hs)], ["hs_3.safetensors", "truncated", "rerun 02_extract_hidden_states.py"]),
        (["--vocab-mapping", str(bad_vocab)], ["d2t [100]", "rerun 03_build_vocab_mapping.py"]),
        (["--vocab-mapping", str(stages["prepared"])], ["is the output of stage 'prepare'"]),
        (["--total-seq-len", "100"], ["--total-seq-len 100", "longest row"]),
        (["--lr", "5"], ["--lr 5"]),
        (["--layer-ids", "3,15,27"], ["--layer-ids [3, 15, 27]", "stage 02 extracted [2, 15, 27]"]),
        (["--engine-gpus", "0"], ["--engine-gpus", "only with --online"]),
        (["--hidden-state", "x"], ["unknown flag --hidden-state", "did you mean --hidden-states"]),
    ]
    for extra, needles in cases:
        argv = train_args(model_path, stages, out)
        p, secs = run_script(*argv, *extra)
        assert_refused(p, secs, *needles)
    assert not out.exists()
