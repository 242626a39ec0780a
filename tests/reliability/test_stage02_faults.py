"""Stage 02 under faults, through its command line and real SmolLM2 (HF backend, CPU): SIGKILL at five points of
a run (two here, three in slow/test_faults.py), SIGTERM, a disk that fills mid-run, and corrupt files left in the output folder. After each, a rerun of
the same command must finish with every row's file present and valid and the manifest right."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, assert_refused, loaded_nothing, rows_of, run_script
from faults import assert_complete, cmd, stage02_killed_at
from eagle3pipe.hidden_states import check_file, hs_path


def test_sigterm_finishes_the_batch_in_flight_and_says_how_to_resume(stages, model_path, tmp_path):
    """...and the rerun, under another --dtype, records both compute dtypes: the stopped run's too."""
    out = tmp_path / "hs"
    err = open(tmp_path / "err", "w")
    proc = subprocess.Popen([sys.executable, *cmd(model_path, stages["prepared"], out, "--batch-size", "1", "--dtype",
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
    assert 0 < len(done) < len(rows_of(stages["prepared"]))
    assert not [n for n in os.listdir(out) if ".tmp-" in n]
    p, _ = run_script(*cmd(model_path, stages["prepared"], out, "--dtype", "float32"))
    assert p.returncode == 0, p.stderr[-2000:]
    m = assert_complete(stages["prepared"], out)
    assert m["counts"]["resumed"] == len(done)
    assert m["compute_dtypes"] == ["bfloat16", "float32"] and m["compute_dtype"] == "mixed", m["compute_dtypes"]


def test_stage01_rewritten_under_a_running_stage02_stops_it_with_one_line(stages, model_path, tmp_path):
    """Stage 01 reruns into the folder stage 02 is reading: stage 02 stops with one line naming it (exit 1), before
    it writes a manifest over files of two inputs."""
    prep, out = tmp_path / "prepared", tmp_path / "hs"
    shutil.copytree(stages["prepared"], prep)
    err = open(tmp_path / "err", "w")
    proc = subprocess.Popen([sys.executable, *cmd(model_path, prep, out, "--batch-size", "1")], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.time() + 300
    while time.time() < deadline and not (out.exists() and any(n.startswith("hs_") for n in os.listdir(out))):
        time.sleep(0.05)
    proc.send_signal(signal.SIGSTOP)  # held while stage 01 rewrites its input
    try:
        p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "6", "--max-seq-len",
                          "512", "--output-dir", str(prep))
        assert p.returncode == 0, p.stderr[-2000:]
    finally:
        proc.send_signal(signal.SIGCONT)
    rc = proc.wait(timeout=300)
    err.close()
    text = (tmp_path / "err").read_text()
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert rc == 1 and len(lines) == 1 and "Traceback" not in text, text[-3000:]
    assert f"--prepared-data {prep}: changed while this stage ran" in lines[0], lines
    assert not (out / "manifest.json").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A real, size-limited filesystem (tmpfs); the test is skipped where mounting is not allowed."""
    d = tmp_path / "disk"
    d.mkdir()

    def mount(mib):
        subprocess.run(["umount", str(d)], capture_output=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        return d
    yield mount
    subprocess.run(["umount", str(d)], capture_output=True)


def test_full_disk_mid_run_is_one_line_and_a_rerun_with_space_completes(stages, model_path, small_disk):
    prep = stages["prepared"]
    need = sum(len(r["input_ids"]) for r in rows_of(prep)) * (4 * 576 * 2 + 8)
    disk = small_disk(int(need * 1.5) // 2**20 + 2)
    out = disk / "hs"
    proc = subprocess.Popen([sys.executable, *cmd(model_path, prep, out, "--batch-size", "1")], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (out.exists() and any(n.startswith("hs_") for n in os.listdir(out))):
        time.sleep(0.05)
    with open(disk / "ballast", "wb") as f:  # someone else fills the disk while the stage runs
        try:
            while True:
                f.write(b"\0" * 2**20)
        except OSError:
            pass
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr[-2000:]
    line = [l for l in stderr.splitlines() if l.startswith("error: ")]
    assert len(line) == 1 and f"--output-dir {out}: disk full" in line[0] and "GB more needed" in line[0], stderr
    assert not [n for n in os.listdir(out) if ".tmp-" in n]  # no partial file, under any name
    rows = [r["input_ids"] for r in rows_of(prep)]
    for n in os.listdir(out):  # whatever was written is complete
        if n.startswith("hs_"):
            i = int(n[3:-12])
            assert check_file(hs_path(out, i), rows[i], 4, 576) is None
    os.remove(disk / "ballast")
    p, _ = run_script(*cmd(model_path, prep, out))
    assert p.returncode == 0, p.stderr[-2000:]
    assert_complete(prep, out)


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


@pytest.mark.parametrize("point", ["write"])  # load, batch, between and end: slow/test_faults.py
def test_sigkill_then_rerun_completes(stages, model_path, tmp_path, point):
    stage02_killed_at(point, stages, model_path, tmp_path)
