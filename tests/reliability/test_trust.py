"""Trust, on the real stages with small data: a stage deletes or replaces only what it made, one run at a time holds
a folder, bad numbers are refused before anything exists, and a stage 01 row edited after stage 02 ran is named.

Every refusal: exit 2, exactly one `error:` line, no traceback, under 3 s, and every file the stage did not create
still there, byte for byte (the folder's own dot-files included)."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO, TRAINED_EPOCHS, assert_refused, run_script, snapshot, train_args


def script(name):
    return os.path.join(REPO, name)


@pytest.fixture(scope="module")
def prep(tmp_path_factory, model_path):
    out = tmp_path_factory.mktemp("trust") / "prepared"
    p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "12", "--max-seq-len",
                      "256", "--output-dir", str(out))
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture
def user_folder(tmp_path):
    """A folder an operator works in: a git repo, an env file, notes."""
    home = tmp_path / "work"
    (home / ".git" / "objects").mkdir(parents=True)
    (home / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (home / ".env").write_text("TOKEN=secret\n")
    (home / "notes.md").write_text("# my notes\n")
    return home


def test_empty_output_paths_are_refused_by_every_stage(prep, model_path, tmp_path, user_folder):
    before = snapshot(user_folder, prep)
    for argv in (["01_prepare_dataset.py", "--model-path", model_path, "--output-dir", ""],
                 ["02_extract_hidden_states.py", "--model-path", model_path, "--prepared-data", str(prep),
                  "--output-dir", ""],
                 ["03_build_vocab_mapping.py", "--prepared-data", str(prep), "--output-dir", ""],
                 ["04_train.py", "--model-path", model_path, "--output-dir", ""],
                 ["05_evaluate.py", "--model-path", model_path, "--output-dir", ""]):
        p, secs = run_script(script(argv[0]), *argv[1:], cwd=user_folder)
        assert_refused(p, secs, "--output-dir: empty path")
    cfg = tmp_path / "c.yaml"  # an empty output key in a config file is refused naming the file and the key
    cfg.write_text('vocab_mapping: ""\n')
    p, secs = run_script(script("03_build_vocab_mapping.py"), "--config", str(cfg), "--prepared-data", str(prep),
                         cwd=user_folder)
    assert_refused(p, secs, f"--config {cfg}: key 'vocab_mapping' is empty")
    assert snapshot(user_folder, prep) == before


@pytest.mark.parametrize("out,needle", [(".", "is the working folder"), ("..", "contains the working folder"),
                                        ("~", "your home folder")])
def test_the_working_folder_its_parents_and_home_are_refused(prep, model_path, user_folder, out, needle):
    before = snapshot(user_folder, prep)
    for argv in (["01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "2"],
                 ["03_build_vocab_mapping.py", "--prepared-data", str(prep)]):
        p, secs = run_script(script(argv[0]), *argv[1:], "--output-dir", out, cwd=user_folder)
        assert_refused(p, secs, needle)
    assert snapshot(user_folder, prep) == before


def test_a_folder_holding_only_dot_files_is_not_taken(prep, user_folder):
    os.remove(user_folder / "notes.md")  # left: .git/ and .env
    before = snapshot(user_folder)
    p, secs = run_script("03_build_vocab_mapping.py", "--prepared-data", str(prep), "--draft-vocab-size", "64",
                         "--output-dir", str(user_folder))
    assert_refused(p, secs, "holds '.env'", "never deletes or replaces")
    assert snapshot(user_folder) == before


def test_a_stage_rerun_never_replaces_a_folder_holding_anything_else(prep, model_path, tmp_path):
    out = tmp_path / "vocab"
    argv = ["03_build_vocab_mapping.py", "--prepared-data", str(prep), "--draft-vocab-size", "64", "--output-dir",
            str(out)]
    p, _ = run_script(*argv)
    assert p.returncode == 0, p.stderr
    (out / "notes.txt").write_text("why K=64\n")
    (out / "other_run").mkdir()  # a person's folder, or another run nested inside
    (out / "other_run" / "manifest.json").write_text("{}")
    before = snapshot(out, prep)
    p, secs = run_script(*argv)
    assert_refused(p, secs, "holds 'notes.txt'")
    assert snapshot(out, prep) == before
    # stage 02 cannot nest its folder inside its own input either
    p, secs = run_script("02_extract_hidden_states.py", "--model-path", model_path, "--prepared-data", str(prep),
                         "--output-dir", str(prep / "hs"), "--max-seq-len", "256", "--backend", "hf")
    assert_refused(p, secs, "is inside the input --prepared-data")
    assert snapshot(out, prep) == before and not (prep / "hs").exists()


def test_a_dataset_inside_the_output_folder_is_refused_not_deleted(model_path, tmp_path):
    out = tmp_path / "prepared"
    out.mkdir()
    data = out / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello!"}]}) + "\n")
    before = snapshot(tmp_path)
    p, secs = run_script("01_prepare_dataset.py", "--model-path", model_path, "--dataset", str(data), "--output-dir",
                         str(out))
    assert_refused(p, secs, "contains the input --dataset")
    assert snapshot(tmp_path) == before


@pytest.fixture(scope="module")
def hs(prep, model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("trust_hs") / "hs"
    p, _ = run_script("02_extract_hidden_states.py", "--model-path", model_path, "--prepared-data", str(prep),
                      "--output-dir", str(out), "--max-seq-len", "256", "--backend", "hf")
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def test_overwrite_never_touches_lookalike_names(hs, prep, model_path):
    argv = ["02_extract_hidden_states.py", "--model-path", model_path, "--prepared-data", str(prep), "--output-dir",
            str(hs), "--max-seq-len", "256", "--backend", "hf", "--overwrite"]
    planted = [hs / "hs_backup_2025", hs / "manifest.json.bak", hs / "hs_007.safetensors", hs / "hs_99.safetensors"]
    planted[0].mkdir()
    (planted[0] / "hs_0.safetensors").write_bytes(b"a person's backup")
    for p in planted[1:]:
        p.write_bytes(b"a person's file")
    (hs / "extract.log").write_text("scripts/extract.sh's log\n")
    try:
        before = snapshot(hs)
        p, secs = run_script(*argv)
        assert_refused(p, secs, "holds 'hs_007.safetensors'", "did not make")
        assert snapshot(hs) == before
    finally:
        shutil.rmtree(planted[0])
        for p in planted[1:]:
            os.remove(p)
    p, _ = run_script(*argv)  # only ours now: --overwrite redoes every row and keeps the launcher's log
    assert p.returncode == 0, p.stderr[-3000:]
    assert (hs / "extract.log").read_text() == "scripts/extract.sh's log\n"
    assert json.load(open(hs / "manifest.json"))["counts"]["resumed"] == 0


def test_a_second_run_on_the_same_folder_is_refused_and_the_first_completes(prep, model_path, tmp_path):
    out = tmp_path / "hs"
    argv = [sys.executable, "02_extract_hidden_states.py", "--model-path", model_path, "--prepared-data", str(prep),
            "--output-dir", str(out), "--max-seq-len", "256", "--backend", "hf", "--batch-size", "1"]
    first = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # another live writer
    try:
        lock = out / ".eagle3.lock"
        deadline = time.time() + 60
        while not (lock.exists() and lock.read_text().startswith("PID")) and first.poll() is None:
            assert time.time() < deadline
            time.sleep(0.05)
        # a temporary file of a live process: neither run may delete it
        live_tmp = out / f".hs_5.safetensors.tmp-{writer.pid}-0a1b2c3d"
        live_tmp.write_bytes(b"in flight")
        p, secs = run_script(*argv[1:])
        assert_refused(p, secs, "in use by another run", f"PID {first.pid}")
        assert live_tmp.read_bytes() == b"in flight"
    finally:
        stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-3000:]
    assert json.load(open(out / "manifest.json"))["complete"] and live_tmp.read_bytes() == b"in flight"
    writer.kill()
    writer.wait()
    p, secs = run_script(*argv[1:])  # its writer is gone, but no record says this stage made it: named, and kept
    assert_refused(p, secs, f"holds '{live_tmp.name}'")
    assert live_tmp.read_bytes() == b"in flight"


def test_bad_numbers_are_refused_before_anything_exists(stages, model_path, tmp_path):
    out = tmp_path / "ckpt"
    for flags, needle in ((["--checkpoint-freq", "nan"], "--checkpoint-freq nan: must be a finite number"),
                          (["--warmup-steps", "-5"], "--warmup-steps -5: must be at least 0"),
                          (["--num-workers", "-1"], "--num-workers -1: must be at least 0"),
                          (["--lr", "inf"], "--lr inf")):
        p, secs = run_script(*train_args(model_path, stages, out, *flags))
        assert_refused(p, secs, needle)
    assert not out.exists()


def test_a_stage01_row_edited_after_stage02_is_named(stages, model_path, tmp_path):
    prep = tmp_path / "prepared"
    shutil.copytree(stages["prepared"], prep)
    lines = (prep / "tokenized_data.jsonl").read_text().splitlines(keepends=True)
    edited = json.loads(lines[3])
    edited["input_ids"][5] = (edited["input_ids"][5] + 1) % 49152
    (prep / "tokenized_data.jsonl").write_text("".join(lines[:3] + [json.dumps(edited) + "\n"] + lines[4:]))
    d = dict(stages, prepared=prep)
    p, secs = run_script(*train_args(model_path, d, tmp_path / "ckpt"))
    assert_refused(p, secs, "row 3 (line 4)", "hs_3.safetensors", "rerun 01_prepare_dataset.py")
    masked = json.loads(lines[7])  # the same ids, one loss-mask bit flipped: no row's tokens differ, the hash does
    masked["loss_mask"][0] = 1 - masked["loss_mask"][0]
    (prep / "tokenized_data.jsonl").write_text("".join(lines[:7] + [json.dumps(masked, separators=(",", ":")) + "\n"]
                                                       + lines[8:]))
    p, secs = run_script(*train_args(model_path, d, tmp_path / "ckpt"))
    assert_refused(p, secs, "was edited after stage 01", "content_id")
    (prep / "tokenized_data.jsonl").write_text("".join(lines[:2]) + "{not json\n" + "".join(lines[3:]))
    p, secs = run_script(*train_args(model_path, d, tmp_path / "ckpt"))
    assert_refused(p, secs, "tokenized_data.jsonl:3: malformed row")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("content,needle", [
    ("[]", "expected a JSON object, got list"),
    ('{"stage": "prepare", "format_version": 1, "args": {}}', "field 'content_id' is missing"),
    ("[" * 100000, "nested too deep"),
    ('{"stage": "prepare"', "not valid JSON"),
])
def test_manifests_that_are_not_what_a_stage_wrote(prep, tmp_path, content, needle):
    bad = tmp_path / "prepared"
    shutil.copytree(prep, bad)
    (bad / "manifest.json").write_text(content)
    p, secs = run_script("03_build_vocab_mapping.py", "--prepared-data", str(bad), "--output-dir", str(tmp_path / "v"))
    assert_refused(p, secs, needle)
    assert not (tmp_path / "v").exists()


def test_a_checkpoint_folder_with_a_person_s_folder_is_not_resumed_or_cleared(trained, stages, model_path, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(trained[0], out, symlinks=True)
    (out / "2025").mkdir()  # speculators would take a number-named folder for its epoch 2025 and resume from it
    (out / "2025" / "plan.txt").write_text("a person's plan\n")
    before = snapshot(out)
    for extra in ([], ["--overwrite"]):
        p, secs = run_script(*train_args(model_path, stages, out, "--epochs", str(TRAINED_EPOCHS), "--lr", "3e-3", *extra))
        assert_refused(p, secs, "holds '2025'")
    assert snapshot(out) == before
