"""Output folders: what a stage may take, the claim, and the only ways a stage writes, renames or deletes.

The rules (an operator's folder holds their notes, their git repo, another run; losing one of their files is the
worst bug this project can have), each enforced here (the record in ledger.py, the lock in locks.py):
- An output path is refused when it is empty, `/`, the home folder, the repository root, the working folder, an
  ancestor of any of those, an input of the same run, inside an input, or containing one. A symlink is resolved
  first, so the checks apply to the real folder.
- Ownership is identity, recorded after creation (ledger.py: `LEDGER`, one JSON line per thing the stage made,
  and what identity means). A user's file of the same name, or our file edited since, does not match and is never
  deleted or replaced. The record's API (`record`, `owned`, `forget`, `attach`) is reached through this module.
- A stage takes a folder only if it is new, empty (dot-files count: `.git/`, `.env` are someone's), or every entry
  at its top is one the record says the stage made. Inside its own subfolders it leaves anything else alone.
- Nothing is written, renamed or deleted through a link the stage did not make: temporary files and the lock are
  opened with O_CREAT|O_EXCL|O_NOFOLLOW (or O_NOFOLLOW), subfolders are made here and checked to be real folders,
  and deletion removes a link itself, never its target.
- A path another process hands back (an engine's file) is used only if it resolves inside a spool this stage made.
- One writer per folder (locks.py): an advisory lock (`LOCK`) held for the whole run. `--shard` replicas share it
  and each holds its own shard lock; any other second run is refused with one line naming the process that holds it.
"""
import errno
import json
import logging
import os
import re
import stat
import time

from . import locks
from .. import REPO
from ..base import faults, handoff
from ..base.errors import RunError, UsageError, quote
from .ledger import (LEDGER, OLD_RECORD, TEMP, Ledger, claimed, exclusive_temp, forget, identity, inside as _inside,
                     ledger_of, open_beneath, open_plain, owned, record, temp_name)
from .locks import LOCK, SHARD_LOCK
from .ledger import attach, record_tree  # noqa: F401 (the record's API, which the stages reach through this module)

# scripts/extract.sh opens its log before stage 02 starts: stage 02 accepts these, and never deletes them
LAUNCHER = re.compile(r"extract(\.shard-\d+)?\.(log|pid)")
log = logging.getLogger("eagle3")
_growing = set()  # the logs this process appends to (outdir.finish)
_children_write = set()  # of them, those its children write to after it has finished


def _real(path):
    return os.path.realpath(os.path.expanduser(path))


# the kernel's own filesystems: writable to access(), where no folder can be made (ramfs and tmpfs, whose statvfs
# can say 0 blocks too, are real places to write)
PSEUDO_FS = {"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "bpf", "pstore",
             "efivarfs", "fusectl", "binfmt_misc", "mqueue", "devpts"}


def _fs_type(real):
    """The type of the filesystem mounted deepest above the real path `real` (/proc/self/mounts), or None."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return None
    held = [(m, kind) for m, kind in ((m.replace("\\040", " "), kind) for m, kind in mounts) if _inside(real, m)]
    return max(held, key=lambda mk: len(mk[0]))[1] if held else None


def _dangling_links(flag, path):
    """Refuse a path through a link that leads nowhere (a data -> /mnt/disk link while the disk is unmounted):
    creating the folder would make the link's target, on whatever disk holds its parent. Every component is looked
    at as the OS walks it, a trailing slash and a link loop included."""
    given = os.path.expanduser(str(path))
    walked = os.sep if os.path.isabs(given) else ""
    for part in [c for c in given.split(os.sep) if c]:
        walked = os.path.join(walked, part)
        if os.path.islink(walked) and not os.path.exists(walked):
            try:
                os.stat(walked)
                why = "which does not exist"
            except OSError as e:
                why = "a loop of links" if e.errno == errno.ELOOP else "which does not exist"
            where = "" if os.path.normpath(walked) == os.path.normpath(given) else f" ({quote(walked)})"
            raise UsageError(f"{flag} {path}: passes through a link{where} to {quote(os.readlink(walked))}, {why}; "
                             f"give an existing folder or a new path")


def check_path(flag, path, inputs=()):
    """The real output path, or a one-line refusal. `inputs`: [(flag, path)] of this run's local inputs."""
    if path is None or not str(path).strip():
        raise UsageError(f"{flag}: empty path; give a folder for this stage's output")
    _dangling_links(flag, path)
    real = _real(path)
    for what, p in (("the filesystem root", "/"), ("your home folder", os.path.expanduser("~")),
                    ("the repository root", REPO), ("the working folder", os.getcwd())):
        if _inside(_real(p), real):
            where = "is" if _real(p) == real else "contains"
            raise UsageError(f"{flag} {path}: {where} {what} ({_real(p)}); give a folder of its own")
    for in_flag, p in inputs:
        if not p or not os.path.exists(p):
            continue
        rin = _real(p)
        if _inside(real, rin) or _inside(rin, real):
            rel = "is" if rin == real else "is inside" if _inside(real, rin) else "contains"
            raise UsageError(f"{flag} {path}: {rel} the input {in_flag} {p}; give a separate output folder")
    if os.path.exists(real) and not os.path.isdir(real):
        raise UsageError(f"{flag} {path}: is a file, expected a folder")
    up = os.path.dirname(real)
    while up != os.path.dirname(up):
        if os.path.lexists(up) and not os.path.isdir(up):
            raise UsageError(f"{flag} {path}: {quote(up)} is a file, not a folder")
        if os.path.lexists(os.path.join(up, LEDGER)) or os.path.lexists(os.path.join(up, OLD_RECORD)):
            # the stage that owns `up` would find a stranger at its next run (a rerun, a resume) and stop
            raise UsageError(f"{flag} {path}: inside {quote(up)}, a stage's output folder; give a folder beside "
                             f"it, not inside it")
        up = os.path.dirname(up)
    return real


# ---------------------------------------------------------------------------------------------- the only writes

def _planned(tmp):
    """Record a temporary name before it exists, so a writer killed right after making it left a recorded file."""
    led, rel = ledger_of(tmp)
    if led is not None:
        led.append(rel, ["t", 0, 0, 0, 0, ""])


def new_temp(path):
    """A fresh temporary file beside `path` (O_EXCL|O_NOFOLLOW), recorded before it is made: a killed writer's
    temporary file is then the stage's to delete."""
    for _ in range(8):
        tmp = temp_name(path)
        _planned(tmp)
        try:
            os.close(open_beneath(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC))
            return tmp
        except FileExistsError:
            forget(tmp)  # someone else's: never ours
    raise RunError(f"{quote(os.path.dirname(os.path.abspath(path)))}: cannot create a temporary file beside "
                   f"{quote(os.path.basename(path))}")


def install(src, path):
    """Rename the stage's finished file `src` onto `path`: only if nothing is there, or what is there is the stage's
    own (a link at `path` is replaced, never followed). What proves the file the stage's is recorded before the
    rename (a rename keeps inode, size, time and first bytes): a temporary's whole identity under its fresh name
    (ledger.Ledger._renamed_temp), or the new name itself where nothing is there to lose; the new name after it. A
    process killed between the rename and its record left a file the record still proves the stage's."""
    check_replaceable(path)
    led, rel = ledger_of(path)
    if led is None:  # outside a claimed folder: nothing to record
        os.replace(src, path)
        forget(src)
        return
    ident = identity(os.lstat(src), src)
    src_led, src_rel = ledger_of(src)
    if src_led is led and TEMP.fullmatch(os.path.basename(src)):
        led.append(src_rel, ["t", *ident[1:]])
    elif not os.path.lexists(path):
        led.append(rel, ident)
    os.replace(src, path)
    faults.kill_point("installed")  # a reliability test: renamed into place, the new name not yet recorded
    led.append(rel, ident)
    forget(src)


def check_replaceable(path, wait=0.5):
    """Refuse to replace what is at `path` unless it is the stage's. Another process of the stage (a --shard
    replica) renames its file into place and records it a moment later: a file not in the record yet is looked at
    again for up to `wait` seconds before it counts as someone else's."""
    led, rel = ledger_of(path)
    deadline = time.time() + wait
    while led is not None and os.path.lexists(path) and not led.owns(rel) and time.time() < deadline:
        time.sleep(0.05)
    if led is not None and os.path.lexists(path) and not led.owns(rel):
        raise RunError(f"{quote(path)}: appeared during the run and is not this stage's; it is left alone: move it "
                       f"away and rerun")


def open_append(path, flags=os.O_WRONLY | os.O_APPEND, handed_on=False, children_write=False):
    """A file descriptor that appends to (or locks) a log or lock file of the stage's, created if absent; never
    through a link, never someone else's file. `handed_on`: another process keeps appending after this one exits (the
    stage a launcher starts), so it stays a growing file in the record. `children_write`: this process's children
    (vLLM's engine processes, and its exit handlers here) write their last lines after the stage has finished: at a
    normal exit it is recorded as a growing file by its first bytes, not as a finished one (a copy of the folder was
    refused as changed). -> fd (RunError, one line, otherwise)."""
    led, rel = ledger_of(path)
    existed = os.path.lexists(path)
    if led is not None and existed and not led.owns(rel):
        raise RunError(f"{quote(path)}: is not this stage's file (a link, or someone else's); it is left alone: move "
                       f"it away and rerun")
    fd = open_plain(path, flags | os.O_CREAT, RunError, "cannot open it", "move it away and rerun")
    os.set_blocking(fd, True)
    if not existed or (led is not None and led.entries.get(rel, ["g"])[0] != "g"):
        record(path, "g")
    if led is not None and not handed_on:
        _growing.add(path)
        if children_write:
            _children_write.add(path)
    return fd


def finish():
    """At a normal exit: the logs this process appended to are finished files again (size, time and head hash), so
    the folder still counts as the stage's after it is copied elsewhere with its times kept; a log its children still
    write to (`children_write`) stays a growing one, identified by its first bytes as they are now."""
    for path in sorted(_growing):
        led, rel = ledger_of(path)
        if led is not None and led.owns(rel):
            try:
                record(path, "g" if path in _children_write else None)
            except OSError:
                pass
    _growing.clear()
    _children_write.clear()


def make_dir(path):
    """A subfolder the stage uses: made here and recorded, or one the record says it made. A link, a file, or a
    folder someone else made is refused with one line, never followed or used."""
    led, rel = ledger_of(path)
    if led is None:
        os.makedirs(path, exist_ok=True)
        return path
    try:
        os.mkdir(path)
        record(path)
        return path
    except FileExistsError:
        pass
    if not led.owns(rel):
        raise UsageError(f"{quote(path)}: {'a link' if os.path.islink(path) else 'not a folder this stage made'}; a "
                         f"stage uses only folders it made: move it away and rerun")
    return path


def confined(spool, path):
    """`path`, if it lies inside the spool folder `spool` (both resolved) and is a plain file or not there yet (an
    engine may still be writing it); else None. An engine's answer is used only through this."""
    if not isinstance(path, str) or not path or "\0" in path or not spool:
        return None
    real, top = os.path.realpath(path), os.path.realpath(spool)
    if not _inside(real, top) or real == top or os.path.realpath(os.path.dirname(path)) != os.path.dirname(real):
        return None
    try:
        return path if stat.S_ISREG(os.lstat(path).st_mode) else None
    except FileNotFoundError:
        return path
    except OSError:
        return None


def remove(path, dry_run=False):
    """Delete what the stage made at `path`: a file or link whose identity matches the record, a folder's recorded
    contents and then the folder if nothing else is left. -> the paths left because they are not the stage's (with
    `dry_run`, the paths that would be left; nothing is deleted)."""
    led, rel = ledger_of(path)
    if led is None or not led.owns(rel):
        return [path] if os.path.lexists(path) else []
    if led.entries[rel][0] != "d":
        if not dry_run:
            os.unlink(path)  # a link itself, never its target
            forget(path)
        return []
    left = []
    for name in sorted(os.listdir(path)):
        left += remove(os.path.join(path, name), dry_run)
    if not left and not dry_run:
        os.rmdir(path)
        forget(path)
    return left


def clear_scratch(folder, names):
    """In a folder the stage made for another writer (an engine's spool, speculators' save in progress, datasets'
    table being built), delete the regular files whose names fullmatch `names` (a regex): that writer's files, which
    the record cannot list because another library made them, and links of those names (a link is removed itself,
    never its target). Nothing else there, and nothing in a folder the stage did not make, is touched."""
    if not owned(folder):
        return
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if re.fullmatch(names, name) and (os.path.islink(path) or confined(folder, path)):
            os.unlink(path)
            forget(path)


def replace_dir(src, dst):
    """Rename the stage's complete folder `src` onto `dst`, which must be absent or wholly the stage's (then deleted
    first); the record follows the rename."""
    led, rel = ledger_of(src)
    if os.path.lexists(dst):
        left = remove(dst, dry_run=True)
        if left:
            raise RunError(f"{quote(dst)}: holds {quote(os.path.relpath(left[0], dst))}, which this stage did not make; "
                           f"move it away and rerun (the new copy waits in {quote(src)})")
        remove(dst)
        faults.kill_point("publish")  # a reliability test: the old copy gone, the new one not yet in place
    moved = []
    if led is not None:  # the new names first: a process killed right after the rename left a folder the record
        _, new = ledger_of(dst)  # proves the stage's (a rename keeps every identity inside it)
        moved = [(r, ident) for r, ident in sorted(led.entries.items()) if r == rel or r.startswith(rel + "/")]
        for r, ident in moved:
            led.append(new + r[len(rel):], ident)
    os.rename(src, dst)
    faults.kill_point("renamed")  # a reliability test: the folder renamed, its old names not yet forgotten
    for r, _ in moved:
        led.append(r, None)


def move_aside(src, dst):
    """Rename the stage's folder `src`, which holds files no record proves the stage's, to the new name `dst`: nothing
    in it is deleted or changed, and from then on none of it counts as the stage's (the record forgets it)."""
    led, rel = ledger_of(src)
    if led is None or not led.owns(rel) or led.entries[rel][0] != "d" or os.path.lexists(dst):
        raise RunError(f"{quote(src)}: cannot be moved aside to {quote(dst)}; move it away and rerun")
    os.rename(src, dst)
    for r in sorted(led.entries):
        if r == rel or r.startswith(rel + "/"):
            led.append(r, None)


def symlink(target, path):
    """Point the stage's link `path` at `target` (relative), replacing only the stage's own link there."""
    tmp = temp_name(path)
    _planned(tmp)
    os.symlink(target, tmp)
    install(tmp, path)


def link_file(src, path):
    """A hard link at `path` to the stage's file `src` (one copy on disk), replacing only the stage's own file there;
    made under a temporary name and renamed into place."""
    if not owned(src):
        raise RunError(f"{quote(src)}: not this stage's file; it is left alone: move it away and rerun")
    tmp = temp_name(path)
    _planned(tmp)
    os.link(src, tmp, follow_symlinks=False)
    install(tmp, path)


# --------------------------------------------------------------------------------------------- claim and lock

def _foreign(folder, stage, led):
    """The first entry at the top of `folder` that is not what this stage made (launcher logs count as stage 02's)."""
    for name in sorted(os.listdir(folder)):
        if name in (LEDGER, LOCK) or SHARD_LOCK.fullmatch(name) or (stage == "extract" and LAUNCHER.fullmatch(name)):
            continue
        if led is not None and led.owns(name):
            continue
        if _live_temp(name):  # a live writer's file in flight (a --shard replica's): never ours to touch, not a stranger
            continue
        if led is not None and name in led.entries:
            return name, "it changed since this stage made it, or someone else put it there"
        return name, "this stage did not make it" if led else "the folder is not empty and this stage did not make it"
    return None, None


def check(flag, path, stage, inputs=(), shard=None):
    """Every ownership rule, with no side effect (a dry run calls only this). -> the real path."""
    real = check_path(flag, path, inputs)
    if os.path.isdir(real):
        if os.path.lexists(os.path.join(real, OLD_RECORD)):
            raise UsageError(f"{flag} {path}: written by an earlier version of this pipeline, whose record names its "
                             f"files but cannot tell them from yours; the next stage still reads it as an input, but "
                             f"this stage writes only into a new folder: choose one")
        led = Ledger.load(real)
        if led and led.stage != stage:
            raise UsageError(f"{flag} {path}: holds the output of stage '{led.stage}'; choose another folder")
        if not os.access(real, os.W_OK):
            raise UsageError(f"{flag} {path}: not writable")
        holder = locks.lock_holder(real, shard)  # another run first: its files in flight are not a stranger's
        if holder is not None:
            raise UsageError(f"{flag} {path}: in use by another run ({holder}); wait for it to finish or stop it first")
        name, why = _foreign(real, stage, led)
        if name is not None:
            raise UsageError(f"{flag} {path}: holds '{quote(name)}' ({why}); a stage never deletes or replaces what "
                             f"it did not make: move it away, or choose an empty or new folder")
    else:
        parent = os.path.dirname(real)
        while not os.path.isdir(parent):
            parent = os.path.dirname(parent)
        if not os.access(parent, os.W_OK):
            raise UsageError(f"{flag} {path}: cannot create it ({parent} is not writable)")
        kind = _fs_type(parent)
        if kind in PSEUDO_FS:  # access() says yes there; mkdir fails, after all of the run's reading
            raise UsageError(f"{flag} {path}: cannot create it ({parent} is on {kind}, a filesystem that stores no "
                             f"files)")
        longest = os.pathconf(parent, "PC_NAME_MAX")
        for part in os.path.relpath(real, parent).split(os.sep):
            if len(os.fsencode(part)) > longest:
                raise UsageError(f"{flag} {path}: cannot create it (a name of {len(os.fsencode(part))} bytes, "
                                 f"'{quote(part[:24])}...'; its filesystem allows {longest})")
    return real


def claim(flag, path, stage, inputs=(), shard=None, overwrite=False):
    """Check, create the folder if new, take the lock for this process's life, delete what a dead writer of this
    stage left half-written (recorded temporary files), and, with `overwrite`, everything earlier runs recorded
    (anything else stays, and the log names it). -> the real path."""
    real = check(flag, path, stage, inputs, shard)
    if overwrite and os.path.isdir(real):  # the stage remakes its folders: a stranger inside one stops it, untouched
        _refuse_strangers_inside(real)
    try:
        os.mkdir(real)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(real)
    locks.take(flag, path, real, shard)
    led = Ledger.load(real) or Ledger(real, stage, {})
    if not shard and not handoff.handed():  # a launcher handing its lock over compacted the record just before
        led.write_new(stage)  # compacted; replicas share the record and only append
    else:  # replicas share one record, made whole by whichever comes first, then read by each (its offset with it)
        if not os.path.lexists(os.path.join(real, LEDGER)):
            tmp, fd = exclusive_temp(os.path.join(real, LEDGER))
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps({"stage": stage, "version": 2}) + "\n")
            try:
                os.link(tmp, os.path.join(real, LEDGER))  # fails if another replica's record is there already
            except FileExistsError:
                pass
            os.unlink(tmp)
        led = Ledger.load(real)
    claimed[real] = led
    led.adopt_renamed()  # a writer killed between a rename and its record: the file is the stage's, by identity
    for rel, ident in sorted(led.entries.items()):  # a dead writer's temporary files (or names it never made)
        if ident[0] == "t" and not _live_temp(rel):
            remove(os.path.join(real, rel))
            if not os.path.lexists(os.path.join(real, rel)):
                forget(os.path.join(real, rel))
    if overwrite:
        # the launcher's log and PID file are the running job's own, made just before this run started
        tops = sorted(r for r in led.entries if "/" not in r and not (stage == "extract" and LAUNCHER.fullmatch(r)))
        removed, left = 0, []
        for rel in tops:
            before = len(led.entries)
            left += remove(os.path.join(real, rel))
            removed += before - len(led.entries)
        kept = f"; kept {len(left)} entries it did not make: " + ", ".join(
            quote(os.path.relpath(p, real)) for p in left[:5]) + (" ..." if len(left) > 5 else "") if left else ""
        if removed or left:
            log.info(f"--overwrite: removed {removed} entries earlier runs of this stage made in {quote(real)}{kept}")
    handoff.ready()  # a launcher waiting for this process to hold its folder
    return real


def _refuse_strangers_inside(real):
    """Before --overwrite deletes anything: a file the stage did not make, inside a folder it made and must remake,
    is one line, with nothing deleted and nothing written."""
    led = Ledger.load(real)
    if led is None:
        return
    claimed[real] = led
    try:
        nested = [p for rel in sorted(r for r in led.entries if "/" not in r)
                  for p in remove(os.path.join(real, rel), dry_run=True) if os.path.dirname(os.path.relpath(p, real))]
    finally:
        del claimed[real]
    if nested:
        raise UsageError(f"--overwrite: {quote(os.path.relpath(nested[0], real))} in {quote(real)} is inside a folder "
                         f"this stage made and must remake, but this stage did not make it; move it out and rerun "
                         f"(nothing was deleted)")


def _live_temp(rel):
    m = re.fullmatch(r".*\.tmp-(\d+)-[0-9a-f]+", rel.rsplit("/", 1)[-1])
    return bool(m) and int(m.group(1)) != os.getpid() and locks.pid_alive(int(m.group(1)))
