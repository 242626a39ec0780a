"""Where torch.compile keeps what it compiled for stage 04, so that a rerun, a resume or a second run on the same
machine reuses the draft's compiled step instead of compiling it again (on a GPU speculators compiles the draft's
forward: about two minutes at Kimi's width on a fresh machine, seconds with the cache).

torch's default is `/tmp/torchinductor_<user>`: emptied on reboot on many machines, and in a folder anyone can write
to, where another user could have made that folder first. What is in the cache is loaded as code (pickled graphs and
compiled kernels), so it is used only if it is this user's: a plain folder (not a link) owned by this user that
nobody else can write to, reached through folders nobody else could have changed: every folder above it, on the
path as given and on the path its links lead to, owned by this user or by root, and writable by no one else unless
sticky (/tmp: no one can rename or delete another's entry there). The default is `<XDG_CACHE_HOME or ~/.cache>/eagle3pipe/torch-compile`;
`TORCHINDUCTOR_CACHE_DIR` set by the user is kept, under the same rule. A cache that fails the rule is never read:
one warning line, and this run compiles into a fresh private folder of its own, removed when it ends."""
import atexit
import contextlib
import logging
import os
import shutil
import stat
import tempfile

log = logging.getLogger("eagle3pipe")

ENV = "TORCHINDUCTOR_CACHE_DIR"


@contextlib.contextmanager
def setting_kept():
    """For a block that may import torch._dynamo (transformers' models do): its import writes torch's /tmp default
    into TORCHINDUCTOR_CACHE_DIR when unset, where prepare() would later read it as the user's choice. The setting
    leaves the block as the user left it."""
    unset = ENV not in os.environ
    try:
        yield
    finally:
        if unset:
            os.environ.pop(ENV, None)


def default_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "eagle3pipe", "torch-compile")


def _parents(path):
    """The folders above `path`, nearest first, to the root."""
    out, d = [], os.path.dirname(path)
    while True:
        out.append(d)
        if d == os.path.dirname(d):
            return out
        d = os.path.dirname(d)


def unsafe_parent(path):
    """Why a folder above `path` (as given, and as its links resolve) could have been changed by another user, or
    None. A link above it is followed only if this user or root made it, in a folder only they can change."""
    uid = os.getuid()
    for d in dict.fromkeys(_parents(os.path.abspath(path)) + _parents(os.path.realpath(path))):
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            continue  # made below, private, by this process
        except OSError as e:
            return f"has a folder above it that cannot be read ({d}: {e.strerror})"
        if st.st_uid not in (uid, 0):
            return f"lies under {d}, which belongs to another user (uid {st.st_uid})"
        if stat.S_ISLNK(st.st_mode):  # a link's own mode means nothing; its owner and its folder (next) do
            continue
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            return (f"lies under {d}, which others can write to (mode {stat.S_IMODE(st.st_mode):o}): they could put "
                    f"another folder in its place")
    return None


def distrust(path):
    """Why `path` cannot hold this user's compiled code, or None if it can. A missing folder is made (private), once
    the folders above it are found safe."""
    why = unsafe_parent(path)
    if why is not None:
        return why
    try:
        if not os.path.lexists(path):
            os.makedirs(path, mode=0o700, exist_ok=True)  # another rank may make it between the two lines
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be made or read ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.getuid():
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others can write to it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def prepare():
    """Point torch.compile's cache (and Triton's, inside it, unless TRITON_CACHE_DIR is set) at a folder this user
    owns, before anything compiles and before torch._dynamo is imported: its import sets TORCHINDUCTOR_CACHE_DIR,
    when unset, to torch's default in /tmp, which would then read here as the user's choice (stage 04 calls this from
    train_plan.confirm_device, right after `import torch`). -> (the folder, True if it persists between runs)."""
    path = os.path.abspath(os.environ.get(ENV) or default_dir())
    why = distrust(path)
    if why is None:
        os.environ[ENV] = path
        return path, True
    fresh = tempfile.mkdtemp(prefix="eagle3-compile-")
    atexit.register(shutil.rmtree, fresh, True)
    log.warning(f"compile cache {path} {why}: not trusted, never read; this run compiles into {fresh} (removed at "
                f"the end), so the next run compiles again; set {ENV} to a folder of your own to keep it")
    os.environ[ENV] = fresh
    return fresh, False
