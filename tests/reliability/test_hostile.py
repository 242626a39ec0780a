"""Trust by construction, proved on hostile folders: for each stage, run it once, then for every name it made (the
lock and the record too) plant a link into a sentinel tree outside, and a person's file inside every subfolder it
made; rerun it plainly and with --overwrite. The sentinel tree must be byte-for-byte unchanged, every person's file
still there, and every refusal exactly one `error:` line (helpers: tests/hostile.py; stage 04: tests/slow)."""
import shutil

from conftest import run_script
from hostile import hostile


def test_stage01_and_03_on_hostile_folders(model_path, stages, tmp_path):
    prep = tmp_path / "prep"
    argv01 = lambda out: ["01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "6",  # noqa: E731
                          "--max-seq-len", "128", "--output-dir", str(out)]
    p, _ = run_script(*argv01(prep))
    assert p.returncode == 0, p.stderr
    hostile(argv01, prep, tmp_path / "h01", overwrite=False)  # stages 01 and 03 rewrite their few files every run
    vocab = tmp_path / "vocab"
    argv03 = lambda out: ["03_build_vocab_mapping.py", "--prepared-data", str(stages["prepared"]),  # noqa: E731
                          "--draft-vocab-size", "512", "--output-dir", str(out)]
    p, _ = run_script(*argv03(vocab))
    assert p.returncode == 0, p.stderr
    hostile(argv03, vocab, tmp_path / "h03", overwrite=False)


def test_stage02_on_a_hostile_folder(model_path, stages, tmp_path):
    hs = tmp_path / "hs"
    argv = lambda out: ["02_extract_hidden_states.py", "--backend", "hf", "--model-path", model_path,  # noqa: E731
                        "--prepared-data", str(stages["prepared"]), "--output-dir", str(out), "--max-seq-len", "512",
                        "--dtype", "float32"]
    shutil.copytree(stages["hs"], hs)  # a finished folder, copied with its times: still stage 02's
    p, _ = run_script(*argv(hs))
    assert p.returncode == 0 and "24 of 24 samples already extracted" in p.stderr, p.stderr[-2000:]
    # the lock, the record, the manifest, the run file and two samples (every sample is the same kind of name)
    hostile(argv, hs, tmp_path / "h02", pick=lambda n: not n.startswith("hs_") or n in ("hs_0.safetensors",
                                                                                       "hs_23.safetensors"),
            overwrite=False)
