"""What the hostile-folder tests share (tests/reliability/test_hostile.py, tests/slow/test_hostile_stage04.py): plant a
link at every name a stage made, into a sentinel tree outside, and a person's file in every subfolder it made; rerun
it plainly and with --overwrite; the sentinel must be unchanged, every person's file kept, every refusal one line."""
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
