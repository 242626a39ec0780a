"""scripts/extract.sh: stage 02 in the background, under the stages' own rules (`python -m eagle3pipe.extract.launch`).

    bash scripts/extract.sh [any 02_extract_hidden_states.py flag]
    environment: REPLICAS=N (data-parallel replicas), TP_SIZE and BATCH_SIZE (defaults for --tp-size 8 and
    --batch-size 4; explicit flags and --config win), PYTHON (the interpreter; scripts/extract.sh reads it)

In order (steps 1-3 stop at the first problem with one line, `error: ...`, exit 2, having written nothing):
1. the flags (stage 02's own parser, with the launcher's defaults) and REPLICAS' GPU groups;
2. the launcher's own files in the output folder, extract[.shard-k].log and .pid: absent, or the ones the folder's
   ownership record says it made; never a link or a file with another name (hard link);
3. stage 02's own preflight, in this process: what `--dry-run` runs (preflight.plan, prepare_output), the inputs'
   readability included. `--dry-run` stops here, having started nothing;
4. the folder claimed as the stage claims it (outdir.claim: made if new, recorded, its locks taken in the stage's
   modes): of two launches at the same moment one gets the locks, the other is refused naming the first's PID;
5. each log opened through outdir.open_append (no link followed, recorded), the stage started in its own session
   (`kill -TERM -- -PID` reaches its engine processes) with the locks handed to it (handoff.py), so no other run
   can take the folder in between;
6. up to CONFIRM_S seconds for the stage to say it has claimed the folder, then GRACE_S more to see it alive: one
   that stopped is named by its log's last error line (its exit code, no PID file, the other replicas stopped);
   else each PID file is written atomically (files.atomic_path) and the PIDs, the logs, `tail -f` and how to stop
   them are printed.
"""
import dataclasses
import logging
import os
import re
import select
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time

from . import preflight
from .. import REPO
from ..base import devices, handoff
from ..base.errors import RunError, UsageError, quote
from ..config import cli
from ..engines import engines
from ..storage import locks, outdir
from ..storage.files import atomic_path
from .extract_output import prepare_output

STAGE = "02_extract_hidden_states.py"
ME = "scripts/extract.sh"
CONFIRM_S = 10.0  # the stage claims its folder after reading its rows: seconds; a longer read is said, not waited for
BUSY_S = 5.0  # a launch that lost the race waits this long for the winner to name its stage's PID
GRACE_S = 1.0  # and then this long alive: a stage that fails right after claiming its folder is named too
STOP_S = 10.0  # SIGTERM to SIGKILL, for replicas stopped because one of them failed at start
ENV_HELP = (f"{ME} runs this stage in the background, in its own process group, logging to <output-dir>/extract.log "
            f"(PID in extract.pid). Environment: REPLICAS=N starts N data-parallel replicas (--shard k/N, GPU group "
            f"k of the visible ones, extract.shard-k.log/.pid); TP_SIZE and BATCH_SIZE are the defaults for "
            f"--tp-size (8; none with --backend hf) and --batch-size (4); PYTHON is the interpreter.")


def env_int(name, default=None):
    """A positive integer from the environment (one line naming the variable otherwise); `default` when unset."""
    text = os.environ.get(name, "")
    if not text:
        return default
    if not re.fullmatch(r"[1-9][0-9]{0,5}", text):
        raise UsageError(f"{name}={text}: expected a positive integer")
    return int(text)


def _has(argv, flag):
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _value(argv, flag):
    """The value of the last `flag V` or `flag=V` in argv, else None."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


@dataclasses.dataclass
class Replica:
    args: object            # stage 02's settings record
    argv: list              # its command line after the script
    gpus: object            # CUDA_VISIBLE_DEVICES for it, or None to inherit
    log: str                # file names in the output folder
    pid: str
    proc: object = None
    pipe: int = -1
    state: str = "starting"   # then 'running' (it holds the folder) or 'stopped'
    code: object = None       # its exit code, if it has exited
    since: int = 0            # where this run's lines start in its log


def replicas(stage, argv):
    """The runs to start: [Replica], one per REPLICAS, with the launcher's defaults filled in."""
    n = env_int("REPLICAS", 1)
    tp_env, batch_env = env_int("TP_SIZE"), env_int("BATCH_SIZE")
    chosen = engines.KINDS.get(_value(argv, "--backend") or "")  # the stage refuses a name it does not know
    config, one_device = _has(argv, "--config"), chosen is not None and not chosen.tensor_parallel
    gpus, tp = [], None
    if n > 1:
        if _has(argv, "--shard"):
            raise UsageError(f"--shard with REPLICAS={n}: the launcher gives each replica its shard")
        gpus = devices.gpu_ids()
        explicit = _value(argv, "--tp-size")
        tp = int(explicit) if explicit and explicit.isdigit() else tp_env or len(gpus) // n
        if tp < 1 or n * tp > len(gpus):
            raise UsageError(f"REPLICAS={n} x --tp-size {tp}: needs {n * max(tp, 1)} GPUs; {len(gpus)} visible")
    defaults = []
    if not (_has(argv, "--tp-size") or config or one_device):  # a backend without tensor parallelism (hf)
        defaults += ["--tp-size", str(tp or tp_env or 8)]
    if not (_has(argv, "--batch-size") or config):
        defaults += ["--batch-size", str(batch_env or 4)]
    out = []
    for k in range(n):
        full = defaults + list(argv) + (["--shard", f"{k}/{n}"] if n > 1 else [])
        tag = f".shard-{k}" if n > 1 else ""
        out.append(Replica(stage.parse_args(full), full, ",".join(gpus[k * tp:(k + 1) * tp]) if n > 1 else None,
                           f"extract{tag}.log", f"extract{tag}.pid"))
    return out


def check_own_files(folder, names):
    """Each of the launcher's files in `folder`: absent, or the one it made there (the folder's record says so), a
    plain file with no other name. Nothing is written; a refusal is one line."""
    real = os.path.realpath(folder)
    if not os.path.isdir(real):
        return
    led = outdir.Ledger.load(real)
    for name in names:
        path = os.path.join(real, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        why = ("a link" if stat.S_ISLNK(st.st_mode) else "not a plain file" if not stat.S_ISREG(st.st_mode) else
               "a hard link: another name shares its contents" if st.st_nlink != 1 else
               None if led is not None and led.owns(name) else "not a file this launcher made")
        if why:
            raise UsageError(f"{quote(path)}: {why}; {ME} writes only its own log and PID file there, never through "
                             f"a link, and leaves this one alone: move it away and rerun")


def _busy(out, shard, error):
    """The refusal for a folder another run holds, naming the stage it started (a launcher that just won names its
    stage within a moment); `error` itself when no lock is held."""
    deadline = time.monotonic() + BUSY_S
    holder = locks.lock_holder(out, shard)
    while holder and ME in holder and time.monotonic() < deadline:
        time.sleep(0.1)
        holder = locks.lock_holder(out, shard)
    if not holder:
        return error
    return UsageError(f"--output-dir {out}: in use by another run ({holder}); wait for it to finish or stop it first")


def preflight_run(r):
    """Stage 02's --dry-run, in this process, with the replica's GPUs. -> the real output path."""
    with devices.visible(r.gpus):
        plan = preflight.plan(r.args)
        print(preflight.format_plan(plan), flush=True)
        _, real = prepare_output(dataclasses.replace(r.args, dry_run=True), plan)
    for warning in (plan.compute.warning, plan.warning):  # after every refusal, as the stage does
        if warning:
            logging.getLogger("eagle3").warning(warning)
    return os.path.realpath(real)


def start(r, real):
    """Start the replica in its own session, logging to its log, holding the locks this process took for it."""
    path = os.path.join(real, r.log)
    log = outdir.open_append(path, handed_on=True)
    try:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(log, f"{stamp} {ME}: starting {STAGE} {' '.join(r.argv)}\n".encode("utf-8", "backslashreplace"))
        outdir.record(path, "g")  # its first line is its identity too (a copy of the folder still counts as ours)
        held = [locks.held_lock(real, name) for name, _ in locks.lock_names(r.args.shard)]
        read_end, write_end = os.pipe()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **handoff.env_for(held, write_end)}
        if r.gpus is not None:
            devices.set_visible(env, r.gpus)
        try:
            # from this folder, as the preflight ran: a relative path means the same file to both
            script = os.path.relpath(os.path.join(REPO, STAGE))
            r.proc = subprocess.Popen([sys.executable, script, *r.argv], env=env, stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                      pass_fds=(*held, write_end))
        finally:
            os.close(write_end)
        r.pipe = read_end
    finally:
        os.close(log)
    # until the stage rewrites it, its lock names it (not this launcher, which is about to leave)
    locks.name_lock(held[-1], f"PID {r.proc.pid} on {socket.gethostname()}: {' '.join(r.proc.args[1:])}")


def confirm(reps):
    """Wait (at most CONFIRM_S) until every replica has claimed the folder or one has stopped; each state becomes
    'running', 'starting' (still reading its inputs) or 'stopped'."""
    deadline = time.monotonic() + CONFIRM_S
    waiting = {r.pipe: r for r in reps}
    while waiting and time.monotonic() < deadline:
        ready, _, _ = select.select(list(waiting), [], [], max(0.0, deadline - time.monotonic()))
        for fd in ready:
            r = waiting.pop(fd)
            r.state = "running" if os.read(fd, 1) else "stopped"  # end of file: it died before claiming
            os.close(fd)
            if r.state == "stopped":
                return
    for fd in waiting:
        os.close(fd)
    settled = time.monotonic() + GRACE_S
    while time.monotonic() < settled and all(r.proc.poll() is None for r in reps):
        time.sleep(0.05)


def stop(reps):
    """End what was started (each replica's process group): SIGTERM, then SIGKILL after STOP_S."""
    live = [r for r in reps if r.proc is not None and r.proc.poll() is None]
    for r in live:
        _signal_group(r.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_S
    for r in live:
        try:
            r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(r.proc.pid, signal.SIGKILL)
            r.proc.wait(timeout=STOP_S)


def _signal_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def last_error(path, since=0):
    """The stage's last `error:` line in its log after byte `since` (else its last line), without the prefix."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        start_at = max(since, size - (1 << 16))
        text = os.pread(fd, size - start_at, start_at).decode("utf-8", "replace")
    finally:
        os.close(fd)
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith(f"{ME}:")]
    errors = [line for line in lines if line.startswith("error: ")]
    line = (errors or lines or ["(nothing in its log)"])[-1]
    return line[len("error: "):] if line.startswith("error: ") else line


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    sys.argv[0] = ME  # the parser's name in its messages, and what the folder's lock names while this launcher holds it
    stage = cli.load_script(STAGE)
    if "-h" in argv or "--help" in argv:
        try:
            stage.parse_args(["--help"])
        except SystemExit:
            pass
        print(f"\n{ENV_HELP}")
        return 0
    cli.setup_logging()
    reps = replicas(stage, argv)
    out = reps[0].args.output_dir
    check_own_files(out, [name for r in reps for name in (r.log, r.pid)])
    print(f"{ME}: preflight ({STAGE} --dry-run) ...", flush=True)
    try:
        real = preflight_run(reps[0])
    except UsageError as e:
        raise _busy(out, reps[0].args.shard, e)
    if reps[0].args.dry_run:
        print("dry run: all checks passed; nothing loaded, nothing written, nothing started")
        return 0
    inputs = [("--model-path", reps[0].args.model_path), ("--prepared-data", reps[0].args.prepared_data)]
    for r in reps:  # the stage's own locks, in its modes: another launch now is refused
        try:
            outdir.claim("--output-dir", out, "extract", inputs, r.args.shard)
        except UsageError as e:
            raise _busy(out, r.args.shard, e)
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    t0 = time.monotonic()
    try:
        for r in reps:
            log = os.path.join(real, r.log)
            r.since = os.lstat(log).st_size if os.path.lexists(log) else 0
            start(r, real)
        confirm(reps)
        for r in reps:
            try:  # a pipe closed unread: the stage is exiting
                r.code = r.proc.wait(timeout=STOP_S) if r.state == "stopped" else r.proc.poll()
            except subprocess.TimeoutExpired:
                r.code = None
        dead = next((r for r in reps if r.code not in (None, 0)), None)
        if dead is not None:
            stop(reps)
            why = last_error(os.path.join(real, dead.log), dead.since)
            which = f" (replica {dead.args.shard[0]}/{dead.args.shard[1]}; the others were stopped)" \
                if len(reps) > 1 else ""
            text = (f"stage 02 (PID {dead.proc.pid}) stopped {time.monotonic() - t0:.0f} s after it started{which}, "
                    f"exit {dead.code}: {why} (its log: {quote(os.path.join(real, dead.log))})")
            raise UsageError(text) if dead.code == 2 else RunError(text)
        for r in reps:
            if r.code is not None:  # done already (nothing left to extract): no PID to stop
                continue
            with atomic_path(os.path.join(real, r.pid)) as tmp:
                with open(tmp, "w") as f:
                    f.write(f"{r.proc.pid}\n")
    except BaseException:
        stop(reps)
        raise
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    report(reps, real)
    return 0


def report(reps, real):
    note = "  (still reading its inputs: a problem there is in the log)"
    for r in reps:
        if r.code is not None:
            log = os.path.join(real, r.log)
            print(f"{ME}: stage 02 (PID {r.proc.pid}) already finished: {last_error(log, r.since)}; log: {log}")
    if all(r.code is not None for r in reps):
        return
    if len(reps) == 1:
        r, log = reps[0], os.path.join(real, reps[0].log)
        print(f"{ME}: started PID {r.proc.pid}; log: {log}")
        if r.state == "starting":
            print(note)
        print(f"  tail -f {shlex.quote(log)}")  # a command to paste: a space in the path must not split it
        print(f"  stop: kill -TERM -- -{r.proc.pid}   (its process group: the batch in flight is finished, vLLM's "
              f"processes go too)")
        return
    n = len(reps)
    for k, r in enumerate(reps):
        if r.code is not None:
            continue
        print(f"{ME}: replica {k}/{n} on GPUs {r.gpus}: PID {r.proc.pid}; log: {os.path.join(real, r.log)}"
              + (note if r.state == "starting" else ""))
    print(f"  tail -f {shlex.quote(real)}/extract.shard-*.log")
    print("  stop one: kill -TERM -- -<its PID> (its process group)")


if __name__ == "__main__":
    cli.run(main)
