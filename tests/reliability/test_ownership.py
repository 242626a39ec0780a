"""Ownership across processes: a dead writer's recorded temporary files go when the folder is next claimed (a live
writer's never), and a second writer is refused naming the holder."""
import os
import subprocess
import sys

import pytest

from conftest import REPO
from eagle3pipe.storage import outdir
from eagle3pipe.config.cli import UsageError


def _claim(d, stage="vocab", **kw):
    return outdir.claim("--output-dir", str(d), stage, **kw)


def test_claim_removes_only_dead_writers_recorded_temps_and_overwrite_only_ours(tmp_path):
    d = tmp_path / "out"
    code = (f"import os, sys; sys.path.insert(0, {REPO!r}); from eagle3pipe.storage import outdir; "
            f"outdir.claim('--output-dir', {str(d)!r}, 'vocab'); t = outdir.new_temp({str(d / 'a.npy')!r}); "
            f"os.mkdir({str(d / 'sub')!r}); outdir.record({str(d / 'sub')!r}); "
            f"open({str(d / 'sub' / 'x.npy')!r}, 'w').write('ours'); outdir.record({str(d / 'sub' / 'x.npy')!r}); "
            f"print(t)")
    tmp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.exists(tmp)
    (d / "sub" / "notes.txt").write_text("a person's notes inside our folder\n")
    # the stage must remake sub/ and could not: refused before anything of ours is deleted
    with pytest.raises(UsageError, match="sub/notes.txt.*inside a folder this stage made.*nothing was deleted"):
        _claim(d, overwrite=True)
    assert sorted(os.listdir(d / "sub")) == ["notes.txt", "x.npy"]
    os.rename(d / "sub" / "notes.txt", tmp_path / "notes.txt")
    _claim(d, overwrite=True)
    assert not os.path.exists(tmp)  # a dead writer's recorded temporary file
    assert [n for n in os.listdir(d) if not n.startswith(".")] == []  # all ours went
    os.link(d / outdir.LEDGER, tmp_path / "record-copy")  # a record shared with another path is not trusted
    with pytest.raises(UsageError, match="hard-linked .shared with another path. ownership record"):
        _claim(d)


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    d = tmp_path / "out"
    code = (f"import sys, time; sys.path.insert(0, {REPO!r}); from eagle3pipe.storage import outdir; "
            f"outdir.claim('--output-dir', {str(d)!r}, 'vocab'); print('held', flush=True); "
            f"time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=f"in use by another run \\(PID {holder.pid} "):
            outdir.check("--output-dir", str(d), "vocab")
        # declared shard replicas share the folder, but one shard is never run twice
        with pytest.raises(UsageError, match="in use by another run"):
            outdir.check("--output-dir", str(d), "vocab", shard=(0, 2))
    finally:
        holder.kill()
        holder.wait()
    _claim(d, shard=(0, 2))  # the holder is gone: the lock went with it
    outdir.check("--output-dir", str(d), "vocab", shard=(1, 2))
    with pytest.raises(UsageError, match="in use by another run"):
        outdir.check("--output-dir", str(d), "vocab")


def test_a_refusal_names_the_holder_even_while_it_takes_or_renames_its_lock(tmp_path):
    """The race CI once lost: a launch read the lock between its holder's taking it and naming itself (or between a
    rename's truncate and write) and named 'another process'. A holder that names itself late, then renames itself
    over and over with longer and shorter lines, is always named whole."""
    d = tmp_path / "out"
    d.mkdir()
    code = (f"import fcntl, os, sys, time; sys.path.insert(0, {REPO!r}); from eagle3pipe.storage import locks; "
            f"fd = os.open({str(d / outdir.LOCK)!r}, os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
            f"print('locked', flush=True); time.sleep(0.3); end = time.monotonic() + 30\n"
            f"while time.monotonic() < end:\n"
            f"    for n in (1, 200, 7): locks.name_lock(fd, f'PID {{os.getpid()}} ' + 'x' * n)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for _ in range(300):  # the first reads fall inside the holder's unnamed 0.3 s
            with pytest.raises(UsageError) as refused:
                outdir.check("--output-dir", str(d), "vocab")
            assert f"in use by another run (PID {holder.pid} x" in str(refused.value), refused.value
    finally:
        holder.kill()
        holder.wait()


def test_an_output_inside_a_stage_folder_or_under_a_file_or_through_a_dangling_link_is_refused(tmp_path):
    stage_dir = tmp_path / "vocab_map"
    _claim(stage_dir)  # a stage's output folder, with its record
    for where in (stage_dir / "inner", stage_dir / "a" / "b"):
        # the stage owning stage_dir would find a stranger at its next run and stop: refused before anything exists
        with pytest.raises(UsageError, match=r"inside .*vocab_map, a stage's output folder; give a folder beside"):
            outdir.check("--output-dir", str(where), "evaluate")
        assert not where.exists()
    _claim(tmp_path / "beside", "evaluate")  # beside it is fine
    (tmp_path / "afile").write_text("a person's file\n")
    with pytest.raises(UsageError, match=r"--output-dir .*afile/ev: .*afile is a file, not a folder"):
        outdir.check("--output-dir", str(tmp_path / "afile" / "ev"), "vocab")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    # the link itself, with a trailing slash, or above the folder (data -> an unmounted disk): never its target made
    for given in ("dangling", "dangling/", "dangling/prepared"):
        with pytest.raises(UsageError, match=r"--output-dir .*dangling.*: passes through a link.* to .*nowhere, "
                                             r"which does not exist"):
            outdir.check("--output-dir", str(tmp_path / given), "vocab")
    os.symlink("loopB", tmp_path / "loopA")
    os.symlink("loopA", tmp_path / "loopB")
    with pytest.raises(UsageError, match=r"loopA/x: passes through a link .*loopA.* to loopB, a loop of links"):
        outdir.check("--output-dir", str(tmp_path / "loopA" / "x"), "vocab")
    assert not (tmp_path / "nowhere").exists() and (tmp_path / "afile").read_text() == "a person's file\n"
    # what mkdir would refuse only after the run's reading: a filesystem that stores nothing, a name too long
    with pytest.raises(UsageError, match=r"--output-dir /proc/eagle3-x: cannot create it \(/proc is on proc, a "
                                         r"filesystem that stores no files"):
        outdir.check("--output-dir", "/proc/eagle3-x", "vocab")
    if os.path.isdir("/dev/shm"):  # memory-backed, and a real place to write
        assert outdir.check("--output-dir", "/dev/shm/eagle3-never-made", "vocab") == "/dev/shm/eagle3-never-made"
    with pytest.raises(UsageError, match=r"cannot create it \(a name of 300 bytes, 'aaa.*'; its filesystem allows"):
        outdir.check("--output-dir", str(tmp_path / "new" / ("a" * 300)), "vocab")
    assert not (tmp_path / "new").exists()


def _child(code, **env):
    """`code` in a fresh process (a claim holds its folder's lock for the process's life)."""
    return subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {REPO!r}); "
                           f"from eagle3pipe.storage import outdir; {code}"], capture_output=True, text=True,
                          env=dict(os.environ, **env))


@pytest.mark.parametrize("point", ["installed", "renamed"])
def test_a_kill_between_a_rename_and_its_record_leaves_what_the_record_proves_ours(tmp_path, point):
    """SIGKILL right after a finished file (`installed`) or folder (`renamed`) took its final name, before the record
    said so: the rerun's claim finds it the stage's (its temporary's identity, or the folder's new names, were
    recorded before the rename), so the same command goes on and --overwrite deletes it; a person's file put at that
    name afterwards is refused by --overwrite and left alone."""
    import signal
    d = tmp_path / "out"
    claim = f"outdir.claim('--output-dir', {str(d)!r}, 'vocab'"
    write = (f"from eagle3pipe.storage import files; files.write_json({str(d / 'a.json')!r}, {{'x': 1}})" if point == "installed"
             else f"p = {str(d / 'new')!r}; outdir.make_dir(p); open(p + '/x.npy', 'w').write('ours'); "
                  f"outdir.record(p + '/x.npy'); outdir.replace_dir(p, {str(d / 'sub')!r})")
    p = _child(f"{claim}); {write}", EAGLE3_INJECT_KILL=point)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    made = d / ("a.json" if point == "installed" else "sub")
    theirs = made if point == "installed" else made / "x.npy"
    assert made.exists()
    p = _child(f"{claim}); print(outdir.owned({str(made)!r}), outdir.owned({str(theirs)!r}))")
    assert (p.returncode, p.stdout.split()) == (0, ["True", "True"]), p.stderr[-2000:]  # the same command goes on
    os.unlink(theirs)
    theirs.write_text("a person's file, written after the kill\n")
    p = _child(f"{claim}, overwrite=True)")
    assert p.returncode != 0 and "did not make" in p.stderr and theirs.exists(), p.stderr[-2000:]
    os.unlink(theirs)
    p = _child(f"{claim}, overwrite=True)")
    assert p.returncode == 0 and not made.exists(), p.stderr[-2000:]  # ours: deleted by --overwrite


def test_speculators_reproducibility_files_are_installed_and_recorded_never_written_in_place(tmp_path):
    """speculators' TrainConfig.save (run.yaml, train_command.txt, and speculators.patch from a git checkout) goes
    through adapters.recorded_artifacts: a link put at one of those names is refused, its target untouched; killed
    right after its second file's rename (train_command.txt, which speculators once wrote itself), the rerun's claim
    finds every file there the stage's by the record, and nothing of speculators' own making (its temporaries go to
    a scratch folder)."""
    import signal
    d = tmp_path / "ck"
    target, link = tmp_path / "a person's notes.txt", d / "train_command.txt"
    target.write_text("keep me\n")
    p = _child(f"import os; outdir.claim('--output-dir', {str(d)!r}, 'train'); from eagle3pipe import adapters; "
               f"from speculators.train.config import TrainConfig; "
               f"cfg = TrainConfig.from_flat({{'verifier_name_or_path': 'v', 'data_path': 'd', 'save_path': {str(d)!r}}}); "
               f"ctx = adapters.recorded_artifacts(TrainConfig); ctx.__enter__(); "
               f"os.symlink({str(target)!r}, {str(link)!r})\n"
               f"try: cfg.save({str(d)!r})\nexcept Exception as e: print('refused:', e, flush=True)\n"
               f"os.unlink({str(link)!r}); cfg.save({str(d)!r})", EAGLE3_INJECT_KILL="installed:2")
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert f"refused: {link}: is not this stage's file" in p.stdout, p.stdout[-2000:]
    assert target.read_text() == "keep me\n"
    p = _child(f"import os; outdir.claim('--output-dir', {str(d)!r}, 'train'); print(sorted((n, outdir.owned("
               f"os.path.join({str(d)!r}, n))) for n in os.listdir({str(d)!r}) if not n.startswith('.eagle3')))")
    assert p.returncode == 0, p.stderr[-2000:]
    got = dict(eval(p.stdout.strip().splitlines()[-1]))
    assert {"run.yaml", "train_command.txt"} <= set(got) <= {"run.yaml", "train_command.txt", "speculators.patch"}
    assert all(got.values()), got  # every file there is the stage's: no stray temporary of speculators'
    assert "verifier_name_or_path: v" in (d / "run.yaml").read_text().replace("'", "")


def test_a_lock_copied_with_its_folder_never_names_a_stranger(tmp_path):
    """A folder copied with its lock file carries the old holder's line ("PID n on host: ..."), not its lock. A
    shard replica later shares that lock without renaming it: a refusal names the live replica, never the gone PID."""
    import socket
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    d = tmp_path / "copy"
    d.mkdir()
    (d / outdir.LOCK).write_text(f"PID {gone} on {socket.gethostname()}: 02_extract_hidden_states.py (copied)\n")
    code = (f"import sys, time; sys.path.insert(0, {REPO!r}); from eagle3pipe.storage import outdir; "
            f"outdir.claim('--output-dir', {str(d)!r}, 'vocab', shard=(0, 2)); print('held', flush=True); "
            f"time.sleep(60)")
    replica = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert replica.stdout.readline().strip() == "held"
        with pytest.raises(UsageError) as refused:
            outdir.check("--output-dir", str(d), "vocab")
        assert f"PID {replica.pid} " in str(refused.value) and f"PID {gone} " not in str(refused.value), refused.value
    finally:
        replica.kill()
        replica.wait()
