"""No child outlives its stage: a watchdog process that ends every descendant of the stage once the stage is gone.

A parent-death signal (prctl PR_SET_PDEATHSIG) reaches only the children we start ourselves, is cleared across a
fork, fires on the death of the thread that forked, and can be ignored or handled (vLLM's server, while it starts,
survived SIGTERM). vLLM's `LLM` spawns its EngineCore and workers itself. So `start()` (called before a stage starts
any engine: engine.make_llm, online_engine.Server.start) starts a tiny watchdog, this file run as a script with no
import beyond the standard library, in its own session (a signal to the stage's group does not reach it), with no terminal,
no working folder and none of the stage's files open (its lock included). It:
- holds the read end of a pipe whose only write end the stage holds (closed in forked children): end of file, or a
  new parent, means the stage is gone, however it died (SIGKILL included);
- meanwhile records the stage's descendants every second, each by pid and start time (/proc/PID/stat), so a pid
  reused by someone else's process is never signalled;
- and every process the stage starts carries a token `<pid>.<start time>` of the stage in `EAGLE3_LIFELINE` (its
  environment, inherited by every process spawned after `start()`), which finds the ones started between two scans
  and already re-parented;
- then sends SIGTERM to each of them (and to the process group of each group leader among them), SIGKILL to what
  is left after `GRACE` seconds, and exits.
"""
import ctypes
import os
import select
import signal
import subprocess
import sys
import time

ENV = "EAGLE3_LIFELINE"  # space-separated tokens `<pid>.<start time>` of the stages a process descends from
GRACE = 5.0              # seconds between SIGTERM and SIGKILL
_started = {}            # pid of the stage -> (watchdog pid, write end of its pipe)


def stat(pid):
    """(ppid, pgid, start time in clock ticks since boot, state) of `pid`, or None once it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[1]), int(fields[2]), int(fields[19]), fields[0].decode()


def token(pid=None):
    """`<pid>.<start time>`: a process's name that a later process reusing its pid does not share; None off Linux."""
    pid = pid or os.getpid()
    st = stat(pid)
    return f"{pid}.{st[2]}" if st else None


def start():
    """Start this process's watchdog, once per process (a forked child that calls this gets its own). From here on
    every process this one starts carries its token, and dies with it. Call it from the main thread, before any
    engine or server starts."""
    pid = os.getpid()
    tok = token(pid)
    if pid in _started or tok is None:
        return
    os.environ[ENV] = " ".join([t for t in os.environ.get(ENV, "").split() if t != tok] + [tok])
    r, w = os.pipe()  # neither end is inherited by an exec'd child; a forked one closes w (below)
    try:
        child = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(pid), tok, str(r)],
                                 pass_fds=(r,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, cwd="/", start_new_session=True)
    except OSError:
        os.close(w)
        return
    finally:
        os.close(r)
    _started[pid] = (child, w)


def parent_death_signal(sig, parent=None):
    """Linux: this process gets `sig` when its parent dies, even by SIGKILL; `parent`: the pid that started it, gone
    already: `sig` now. For a process forked (not exec'd) by a stage's main thread, which the watchdog alone can
    miss: its /proc environment lacks the token, so one forked and orphaned between two scans is never found."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent is not None and os.getppid() != parent:  # died before the signal was set
        os.kill(os.getpid(), sig)


def watchdogs():
    """The pids of the watchdogs this process started (they are its children, not an engine's processes)."""
    return [child.pid for child, _ in _started.values()]


def marked(env):
    """`env` (a child's environment being built) with this process's tokens, as os.environ holds them now."""
    if os.environ.get(ENV):
        env[ENV] = os.environ[ENV]
    return env


def _forget_in_child():
    for pid, (_, w) in list(_started.items()):
        try:
            os.close(w)  # a forked child holding the write end would keep the pipe open after the stage died
        except OSError:
            pass
        _started.pop(pid, None)


os.register_at_fork(after_in_child=_forget_in_child)


# ------------------------------------------------------------------------------------------------- the watchdog

def _children(pid):
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def _all():
    """{pid: (ppid, pgid, start, state)} of every live process."""
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = stat(int(name))
            if st:
                procs[int(name)] = st
    return procs


def _carries(pid, tok):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    for var in env.split(b"\0"):
        if var.startswith(ENV.encode() + b"="):
            return tok.encode() in var[len(ENV) + 1:].split()
    return False


class Watch:
    def __init__(self, parent, tok):
        self.parent, self.tok, self.me = parent, tok, os.getpid()
        self.known = {}  # pid -> start time

    def track(self):
        """Record the parent's descendants (the ones alive now; the recorded ones stay recorded while they live)."""
        frontier = [self.parent] + list(self.known)
        seen = set(frontier)
        while frontier:
            for c in _children(frontier.pop()):
                if c in seen or c == self.me:
                    continue
                seen.add(c)
                st = stat(c)
                if st:
                    self.known.setdefault(c, st[2])
                    frontier.append(c)
        for pid, start in list(self.known.items()):
            st = stat(pid)
            if st is None or st[2] != start:
                del self.known[pid]

    def victims(self):
        """Every live process that is the stage's: recorded, carrying its token, or descended from one of those."""
        procs = _all()
        mine = {p: st[2] for p, st in procs.items()
                if p != self.me and (self.known.get(p) == st[2] or _carries(p, self.tok))}
        grew = True
        while grew:
            grew = False
            for p, st in procs.items():
                if p not in mine and p != self.me and st[0] in mine:
                    mine[p] = st[2]
                    grew = True
        self.known.update(mine)
        return {p: (start, procs[p][1]) for p, start in mine.items()}

    def signal_all(self, sig):
        found = self.victims()
        for pid, (start, pgid) in found.items():
            _send(pid, start, sig)
            if pgid == pid:  # a leader of its own group (a server we started): the whole group
                try:
                    os.killpg(pid, sig)
                except OSError:
                    pass
        return found

    def end(self, grace=GRACE):
        if not self.signal_all(signal.SIGTERM):
            return
        deadline = time.time() + grace
        while time.time() < deadline:
            time.sleep(0.1)
            if not self.victims():
                return
        for _ in range(50):  # SIGKILL cannot be refused; a process started meanwhile gets it in the next round
            if not self.signal_all(signal.SIGKILL):
                return
            time.sleep(0.1)


def _send(pid, start, sig):
    """`sig` to `pid` only if it is still the process recorded (same start time); through a pidfd where the kernel
    has them, so the pid cannot be reused between the check and the signal."""
    fd = None
    try:
        if hasattr(os, "pidfd_open"):
            fd = os.pidfd_open(pid)
        st = stat(pid)
        if st is None or st[2] != start:
            return
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
    except OSError:
        pass
    finally:
        if fd is not None:
            os.close(fd)


def main(argv):
    parent, tok, fd = int(argv[0]), argv[1], int(argv[2])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # it ends when its work is done, not before
        signal.signal(sig, signal.SIG_IGN)
    watch = Watch(parent, tok)
    while True:
        if os.getppid() != parent or token(parent) != tok:
            break
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready and not os.read(fd, 64):
            break
        watch.track()
    watch.end(_grace())


def _grace():
    """The stage checked the value (deadlines.check_environment); whatever it is, the watchdog still does its work."""
    try:
        value = float(os.environ.get("EAGLE3_LIFELINE_GRACE") or GRACE)
    except ValueError:
        return GRACE
    return min(max(value, 0.0), 600.0) if value == value else GRACE


if __name__ == "__main__":
    main(sys.argv[1:])
