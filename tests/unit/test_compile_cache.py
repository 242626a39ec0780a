"""Stage 04's torch.compile cache (eagle3pipe/base/compile_cache.py): kept in the user's cache folder between runs, and
read only when it is this user's alone; anything else is one warning line and a fresh private folder for the run.
A second run reusing what the first compiled: tests/slow/test_compile_cache.py."""
import logging
import os
import stat

import pytest

from eagle3pipe.base import compile_cache


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    return tmp_path


def test_the_default_is_a_private_folder_in_the_users_cache(env):
    path, kept = compile_cache.prepare()
    assert kept and path == str(env / "cache" / "eagle3pipe" / "torch-compile") == os.environ[compile_cache.ENV]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert compile_cache.prepare() == (path, True)  # the next run: the same folder


def _refused(caplog, planted, why, env_var=None):
    """prepare() once (as a run does) with the cache folder at `planted`: refused, one line, a fresh private folder."""
    if env_var is None:
        os.environ.pop(compile_cache.ENV, None)  # what the previous call chose is not the user's setting
    else:
        os.environ[compile_cache.ENV] = env_var
    before = sorted(os.listdir(planted)) if os.path.isdir(planted) and not os.path.islink(planted) else None
    with caplog.at_level(logging.WARNING, logger="eagle3pipe"):
        path, kept = compile_cache.prepare()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not kept and path != str(planted) and os.environ[compile_cache.ENV] == path, path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700 and os.listdir(path) == []
    assert len(lines) == 1 and why in lines[0] and "not trusted, never read" in lines[0], lines
    if before is not None:
        assert sorted(os.listdir(planted)) == before  # nothing of the planted cache touched
    caplog.clear()


def test_a_cache_that_is_not_this_users_alone_is_never_read(env, caplog, monkeypatch):
    planted = env / "cache" / "eagle3pipe" / "torch-compile"
    planted.parent.mkdir(parents=True)
    target = env / "elsewhere"
    target.mkdir()
    (target / "graph.pkl").write_bytes(b"code someone else wrote")
    planted.symlink_to(target)  # a link to someone's folder
    _refused(caplog, planted, "is a link")
    planted.unlink()
    planted.mkdir(mode=0o700)
    os.chmod(planted, 0o775)  # a folder the group can write to
    _refused(caplog, planted, "others can write to it (mode 775)")
    os.chmod(planted, 0o700)
    if os.getuid() == 0:  # another user's folder (only root can make one here)
        os.chown(planted, 12345, -1)
        _refused(caplog, planted, "belongs to another user (uid 12345)")
        os.chown(planted, 0, -1)
    _refused(caplog, target / "graph.pkl", "is not a folder", str(target / "graph.pkl"))  # the user's own setting
    monkeypatch.setenv(compile_cache.ENV, str(env / "mine"))
    assert compile_cache.prepare() == (str(env / "mine"), True)


def test_a_cache_reached_through_a_folder_others_could_change_is_never_read(env, caplog):
    """The folder itself may be private and this user's, yet sit under a folder others can write to (they could put
    another folder in its place between the check and a later run), or be reached through a link made in such a
    folder, or lie in another user's folder. A sticky shared folder (/tmp) is safe: no one renames another's entry."""
    shared = env / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # world-writable, not sticky
    (shared / "c").mkdir(mode=0o700)
    _refused(caplog, shared / "c", f"lies under {shared}, which others can write to (mode 777)", str(shared / "c"))
    mine = env / "mine"
    mine.mkdir(mode=0o700)
    (shared / "link").symlink_to(mine)  # a link in a folder anyone can change, to a folder of this user's
    _refused(caplog, mine, f"lies under {shared}, which others can write to", str(shared / "link" / "c"))
    os.chmod(shared, 0o1777)  # sticky, as /tmp is
    assert compile_cache.unsafe_parent(str(shared / "c")) is None
    if os.getuid() == 0:  # another user's folder above it (only root can make one here)
        other = env / "other"
        (other / "c").mkdir(parents=True, mode=0o700)
        os.chown(other, 12345, -1)
        _refused(caplog, other / "c", f"lies under {other}, which belongs to another user (uid 12345)",
                 str(other / "c"))
