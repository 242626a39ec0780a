"""The devices this process may use, read once here: the CPU cores (its affinity within a container's quota), the
RAM available, the NVIDIA GPUs it sees (without importing torch), and what says so: CUDA_VISIBLE_DEVICES (read and
set for children here only) and the launcher's ranks (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE)."""
import contextlib
import math
import os
import subprocess

VISIBLE = "CUDA_VISIBLE_DEVICES"


def visible_setting():
    """CUDA_VISIBLE_DEVICES as this process inherited it (None: unset; "": no GPU)."""
    return os.environ.get(VISIBLE)


def visible_words():
    """How an error line names the setting: `CUDA_VISIBLE_DEVICES=...` (or `=unset`)."""
    return f"{VISIBLE}={os.environ.get(VISIBLE, 'unset')}"


def set_visible(env, value):
    """`env` (a child's environment, or os.environ) with the GPUs `value` names ("" for none; None: unset)."""
    if value is None:
        env.pop(VISIBLE, None)
    else:
        env[VISIBLE] = value
    return env


@contextlib.contextmanager
def visible(value):
    """This process sees the GPUs `value` names for the block (None: as it is), then what it saw before."""
    saved = visible_setting()
    if value is not None:
        os.environ[VISIBLE] = value
    try:
        yield
    finally:
        if value is not None:
            set_visible(os.environ, saved)


def gpu_ids():
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (else nvidia-smi's indices)."""
    cvd = visible_setting()
    if cvd:
        return [g.strip() for g in cvd.split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [g.strip() for g in out.stdout.split()] if out.returncode == 0 else []


def physical(indices):
    """CUDA_VISIBLE_DEVICES entries for indices among this process's visible GPUs."""
    cvd = visible_setting()
    ids = [x.strip() for x in cvd.split(",")] if cvd else None
    return ",".join(ids[i] if ids else str(i) for i in indices)


def rank():
    """This process's global rank under torchrun (0 alone)."""
    return int(os.environ.get("RANK", "0"))


def under_torchrun():
    return "LOCAL_RANK" in os.environ


def local_world_size():
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _affinity():
    """[CPU ids] this process may run on (a `taskset` narrows them)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cores(root="/"):
    """The CPU cores this process may use: its affinity, within a cgroup's CPU quota (a container's) where set."""
    n = len(_affinity())
    quota = cgroup_cpus(root)
    return n if quota is None else min(n, quota)


def cgroup_cpus(root="/"):
    """The cores a cgroup CPU quota allows this process (rounded up), or None where none is set or none is readable:
    cgroup v2's cpu.max, or v1's cpu.cfs_quota_us over cpu.cfs_period_us (-1: none), at the process's own cgroup
    (/proc/self/cgroup) and every ancestor up to the hierarchy's root (a container sees its own limit there); the
    lowest wins. `root`: where / is (tests build a tree of these files). Never raises."""
    def read(path):
        try:
            with open(os.path.join(root, path.lstrip("/"))) as f:
                return f.read().split()
        except (OSError, UnicodeDecodeError):
            return None

    def up(path):  # /a/b -> /a/b, /a, /
        parts = [p for p in path.split("/") if p and p != ".."]
        return ["/" + "/".join(parts[:i]) for i in range(len(parts), -1, -1)]

    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            own = [line.rstrip("\n").split(":", 2) for line in f]
    except (OSError, UnicodeDecodeError):
        own = []
    found = []
    for entry in own:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if controllers == "":  # v2: one hierarchy, where cpu.max is
            for d in up(path):
                v = read(f"/sys/fs/cgroup/{d}/cpu.max")
                if v and len(v) == 2 and v[0] != "max":
                    found.append((v[0], v[1]))
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's mount, named for its controllers
            for mount in dict.fromkeys((controllers, "cpu", "cpu,cpuacct")):
                for d in up(path):
                    q = read(f"/sys/fs/cgroup/{mount}/{d}/cpu.cfs_quota_us")
                    p = read(f"/sys/fs/cgroup/{mount}/{d}/cpu.cfs_period_us")
                    if q and p and q[0] != "-1":
                        found.append((q[0], p[0]))
    limits = []
    for q, p in found:
        try:
            if int(q) > 0 and int(p) > 0:
                limits.append(max(1, math.ceil(int(q) / int(p))))
        except ValueError:
            continue
    return min(limits) if limits else None


def cpu_list():
    """The CPUs vLLM-CPU's OpenMP threads bind to (VLLM_CPU_OMP_THREADS_BIND's form: "0-3,8"): this process's
    affinity (a `taskset` to CPUs 2-3 was bound to 0-1, outside it). Not cut to a container's
    quota: a quota limits time, not which CPUs, and pinning every such container to the host's first CPUs would pile
    them onto the same cores (docs/STAGES.md: set the variable under a quota)."""
    spans = []  # [first, last] of each run of consecutive ids
    for i in _affinity():
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def available_ram():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def visible_gpus():
    """[(name, total bytes)] of the NVIDIA GPUs this process may use, without importing torch."""
    if visible_setting() == "":
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    gpus = []
    for line in out.stdout.strip().splitlines():
        idx, name, mib = [x.strip() for x in line.split(",")]
        gpus.append((idx, name, int(float(mib)) * 2**20))
    cvd = visible_setting()
    if cvd:
        keep = [x.strip() for x in cvd.split(",")]
        gpus = [g for g in gpus if g[0] in keep] if all(k.isdigit() for k in keep) else gpus[: len(keep)]
    return [(name, total) for _, name, total in gpus]
