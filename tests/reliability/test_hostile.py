"""Trust by construction, proved on hostile folders: for each stage, run it once, then for every name it made (the
lock and the record too) plant a link into a sentinel tree outside, and a person's file inside every subfolder it
made; rerun it plainly and with --overwrite. The sentinel tree must be byte-for-byte unchanged, every person's file
still there, and every refusal exactly one `error:` line."""
import hashlib
import os
import shutil


from conftest import run_script



def tree_sum(root):
    """Names, kinds and contents of everything under `root` (links not followed)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            h.update(os.path.relpath(p, root).encode())
            if os.path.islink(p):
                h.update(b"L" + os.readlink(p).encode())
            elif os.path.isfile(p):
                h.update(open(p, "rb").read())
    return h.hexdigest()


def sentinel(tmp_path):
    s = tmp_path / "sentinel"
    (s / "dir").mkdir(parents=True)
    (s / "file.txt").write_text("someone else's file\n")
    (s / "dir" / "inner.txt").write_text("someone else's folder\n")
    return s


def entries(out):
    """Every path the stage made, relative: files, folders, links, its lock and record."""
    found = []
    for dirpath, dirnames, filenames in os.walk(out):
        for name in dirnames + filenames:
            found.append(os.path.relpath(os.path.join(dirpath, name), out))
    return sorted(found)


def plant_link(path, s):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
        os.symlink(s / "dir", path, target_is_directory=True)
    else:
        os.remove(path)
        os.symlink(s / "file.txt", path)


def one_line_or_success(p, what):
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in p.stderr, (what, p.stderr[-3000:])
    if p.returncode != 0:
        assert len(lines) == 1, (what, p.returncode, p.stderr[-3000:])
    print(f"{what}: exit {p.returncode} {lines[0][:150] if lines else ''}")
    return lines[0] if lines else ""


def hostile(argv, out, tmp_path, pick=None, overwrite=True):
    """Plant a link at each made name (all, or `pick` of them) in a copy of `out` and rerun; then plant a person's
    file in every subfolder and rerun, plainly and with --overwrite."""
    s = sentinel(tmp_path)
    before = tree_sum(s)
    names = entries(out)
    for rel in [n for n in names if pick is None or pick(n)]:
        work = tmp_path / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(out, work, symlinks=True)
        if not os.path.lexists(work / rel) or os.path.islink(os.path.dirname(work / rel)):
            continue
        plant_link(str(work / rel), s)
        for extra in ([], ["--overwrite"]) if overwrite else ([],):
            p, _ = run_script(*argv(work), *extra)
            one_line_or_success(p, f"link at {rel} {extra}")
            assert tree_sum(s) == before, f"a link at {rel} ({extra}) let the stage change the sentinel tree"
    work = tmp_path / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(out, work, symlinks=True)
    notes = [work / rel / "notes.txt" for rel in names if os.path.isdir(work / rel) and not os.path.islink(work / rel)]
    for n in notes:
        n.write_text("a person's notes\n")
    for extra in ([], ["--overwrite"]) if overwrite else ([],):
        p, _ = run_script(*argv(work), *extra)
        one_line_or_success(p, f"notes in subfolders {extra}")
        lost = [str(n) for n in notes if not n.exists() or n.read_text() != "a person's notes\n"]
        assert not lost, (lost, p.stderr[-2000:])
    assert tree_sum(s) == before


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


def test_stage04_on_a_hostile_folder(model_path, stages, trained, tmp_path):
    from conftest import TRAINED_EPOCHS, train_args
    argv = lambda out: train_args(model_path, stages, out, "--epochs", str(TRAINED_EPOCHS), "--lr", "3e-3")  # noqa: E731
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained[0], ckpt, symlinks=True)
    # a finished run: a rerun trains nothing and refuses nothing. One made name of each kind gets a link.
    kinds = ("manifest.json", ".eagle3.lock", ".eagle3-owner.jsonl", "last", "logs", "logs/metrics.jsonl", "1",
             "1/model.safetensors", ".bridge", "checkpoint_best")
    hostile(argv, ckpt, tmp_path / "h04", pick=lambda n: n in kinds, overwrite=False)
    # a person's hard link to the stage's run.yaml: speculators rewrites it every run; the person's copy stays
    keep = tmp_path / "run_keep.yaml"
    os.link(ckpt / "run.yaml", keep)
    text = keep.read_text()
    p, _ = run_script(*argv(ckpt))
    assert p.returncode == 0 and keep.read_text() == text, p.stderr[-2000:]
    # a link planted where the next checkpoint will be staged (a name the stage has not made yet): refused, not
    # written through
    s = sentinel(tmp_path / "next")
    before = tree_sum(s)
    work = tmp_path / "next" / "work"
    shutil.copytree(ckpt, work, symlinks=True)
    nxt = str(TRAINED_EPOCHS)  # the epoch a longer run saves next
    os.symlink(s / "dir", work / ".saving" / nxt, target_is_directory=True)
    p, _ = run_script(*train_args(model_path, stages, work, "--epochs", str(TRAINED_EPOCHS + 1), "--lr", "3e-3"))
    assert p.returncode != 0 and f".saving/{nxt}" in one_line_or_success(p, f"link at .saving/{nxt}"), p.stderr[-2000:]
    assert tree_sum(s) == before
    # --overwrite with a person's notes in logs/ and in an epoch folder, which the stage would have to remake:
    # refused before anything is deleted, naming the note; every checkpoint and note stays
    (ckpt / "logs" / "notes.txt").write_text("a person's notes\n")
    (ckpt / "0" / "notes.txt").write_text("a person's notes\n")
    before = tree_sum(ckpt)
    p, _ = run_script(*argv(ckpt), "--overwrite")
    line = one_line_or_success(p, "--overwrite with notes")
    assert p.returncode == 2 and "inside a folder this stage made" in line and "nothing was deleted" in line, line
    assert tree_sum(ckpt) == before and (ckpt / "1" / "model.safetensors").exists()
