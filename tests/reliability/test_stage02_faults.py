"""Stage 02 under faults, through its command line and real SmolLM2 (HF backend, CPU): SIGTERM, a disk too small
for the estimate, corrupt files left in the output folder, token ids outside the vocabulary. After each, a rerun of
the same command must finish with every row's file present and valid and the manifest right. SIGKILL mid-run and
resume is tests/e2e/test_extract.py's; SIGKILL at five points of a run, a disk that fills mid-run and stage 01
rewritten under a running stage 02 are in tests/slow/test_faults.py."""
import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO, assert_refused, loaded_nothing, rows_of, run_script
from faults import assert_complete, cmd


def test_sigterm_finishes_the_batch_in_flight_and_says_how_to_resume(prep, model_path, tmp_path):
    """...and the rerun, under another --dtype, records both compute dtypes: the stopped run's too."""
    out = tmp_path / "hs"
    err = open(tmp_path / "err", "w")
    proc = subprocess.Popen([sys.executable, *cmd(model_path, prep, out, "--batch-size", "1", "--dtype",
                                                  "bfloat16")],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.time() + 300
    while time.time() < deadline and not (out.exists() and any(n.startswith("hs_") for n in os.listdir(out))):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    err.close()
    text = (tmp_path / "err").read_text()
    assert "SIGTERM: finishing the batch in flight" in text and "rerun the same command to resume" in text, text
    assert not (out / "manifest.json").exists()
    done = [n for n in os.listdir(out) if n.startswith("hs_")]
    assert 0 < len(done) < len(rows_of(prep))
    assert not [n for n in os.listdir(out) if ".tmp-" in n]
    p, _ = run_script(*cmd(model_path, prep, out, "--dtype", "float32"))
    assert p.returncode == 0, p.stderr[-2000:]
    m = assert_complete(prep, out)
    assert m["counts"]["resumed"] == len(done)
    assert m["compute_dtypes"] == ["bfloat16", "float32"] and m["compute_dtype"] == "mixed", m["compute_dtypes"]


def test_preflight_refuses_a_disk_too_small_for_the_estimate(stages, model_path, small_disk):
    disk = small_disk(1)
    p, secs = run_script(*cmd(model_path, stages["prepared"], disk / "hs"))
    assert p.returncode == 2 and loaded_nothing(p), (p.heavy, p.stderr)
    assert f"--output-dir {disk / 'hs'}: needs about" in p.stderr and "GB free" in p.stderr
    assert not (disk / "hs").exists()


def test_corrupt_files_are_found_by_the_resume_and_redone(stages, model_path, tmp_path):
    import shutil
    out = tmp_path / "hs"
    shutil.copytree(stages["hs"], out)
    f = out / "hs_2.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: same size, valid header
    f.write_bytes(bytes(data))
    g = out / "hs_3.safetensors"
    st = os.stat(g)
    g.write_bytes(g.read_bytes()[:1000])  # truncated, by a dying disk that kept the file's time
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.remove(out / "hs_4.safetensors")
    shutil.copy(out / "hs_0.safetensors", out / "hs_4.safetensors")  # a valid file of another row, put there by hand
    p, secs = run_script(*cmd(model_path, stages["prepared"], out))
    assert p.returncode == 2 and "holds 'hs_4.safetensors'" in p.stderr, p.stderr[-2000:]  # not ours
    os.remove(out / "hs_4.safetensors")
    p, _ = run_script(*cmd(model_path, stages["prepared"], out))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "hs_2.safetensors: checksum mismatch" in p.stderr
    assert "hs_3.safetensors: unreadable" in p.stderr or "hs_3.safetensors: size" in p.stderr, p.stderr
    assert "3 to go" in p.stderr
    assert_complete(stages["prepared"], out)


def test_token_ids_outside_the_vocab_are_refused_before_anything_is_written(stages, model_path, tmp_path):
    import shutil
    prep = tmp_path / "prep"
    shutil.copytree(stages["prepared"], prep)
    lines = (prep / "tokenized_data.jsonl").read_text().splitlines()
    row = json.loads(lines[2])
    row["input_ids"][5] = 49152  # one past SmolLM2's vocab: a hand-edited or foreign row
    lines[2] = json.dumps(row)
    (prep / "tokenized_data.jsonl").write_text("\n".join(lines) + "\n")
    assert_refused(*run_script(*cmd(model_path, prep, tmp_path / "hs")), "tokenized_data.jsonl:3",
                   "token ids must be in [0, 49152)")
    assert not (tmp_path / "hs").exists()


def test_rows_edited_after_stage01_are_refused_before_the_model_loads(stages, model_path, tmp_path):
    """An edit that keeps every id in the vocabulary passes the row check; the rows' hash against stage 01's manifest
    finds it in the checks (the dry run's too), not after every row is extracted. A file of rows that is not a stage
    01 folder's tokenized_data.jsonl is refused: stage 02 would read the folder's own file instead."""
    import shutil
    prep = tmp_path / "prep"
    shutil.copytree(stages["prepared"], prep)
    lines = (prep / "tokenized_data.jsonl").read_text().splitlines()
    row = json.loads(lines[1])
    row["input_ids"][4], row["input_ids"][5] = row["input_ids"][5], row["input_ids"][4]
    lines[1] = json.dumps(row)
    (prep / "tokenized_data.jsonl").write_text("\n".join(lines) + "\n")
    for extra in ([], ["--dry-run"]):
        assert_refused(*run_script(*cmd(model_path, prep, tmp_path / "hs"), *extra),
                       f"--prepared-data {prep}: tokenized_data.jsonl changed since stage 01 wrote it")
    assert not (tmp_path / "hs").exists()
    stages_copy = tmp_path / "prep2"
    shutil.copytree(stages["prepared"], stages_copy)
    (stages_copy / "subset.jsonl").write_text(lines[0] + "\n")
    assert_refused(*run_script(*cmd(model_path, stages_copy / "subset.jsonl", tmp_path / "hs"), "--dry-run"),
                   "reads the tokenized_data.jsonl of a stage 01 folder")
