"""How many worker processes stage 01 renders and tokenizes with (eagle3pipe/chat/tokenize_workers.py; 0: the stage's own
process): the flag where given, else one for a small job (a process the stage can kill), none after --regenerate,
else the cores up to a cap. The rows they make: C/test_prepare_vocab.py;
their ends: R/test_stage01_workers.py."""
import os

from eagle3pipe.base import devices
from eagle3pipe.chat import tokenize_workers as tw


def test_the_worker_count_follows_the_flag_the_job_and_the_cores():
    cores = len(os.sched_getaffinity(0))
    assert tw.count(3, 10_000) == 3
    assert tw.count(8, 5) == 5                      # never more workers than conversations
    assert tw.count(None, tw.AUTO_MIN_RECORDS - 1) == 1
    assert tw.count(None, 100_000, regenerate=True) == 0  # its engine shares the process: no fork
    assert tw.count(None, 100_000) == min(cores, tw.AUTO_MAX_WORKERS)
    assert tw.count(2, 100_000, regenerate=True) == 2  # asked for: given
    assert tw.count(0, 100_000) == 0                   # a config's num_workers: 0 (stage 04's CPU value too): here
    assert 1 <= devices.cores() <= cores


def _tree(root, files):
    for path, text in files.items():
        p = root / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(root)


def test_a_cgroup_cpu_quota_bounds_the_cores_in_v1_and_v2(tmp_path):
    """A container's CPU quota, as either cgroup version writes it, at the process's own cgroup or the root: a quota
    of 1.5 cores is 2 workers' worth; none set, or nothing readable, leaves the affinity's count."""
    v2 = {"proc/self/cgroup": "0::/job\n", "sys/fs/cgroup/job/cpu.max": "150000 100000\n",
          "sys/fs/cgroup/cpu.max": "max 100000\n"}
    assert devices.cgroup_cpus(_tree(tmp_path / "v2", v2)) == 2
    v2_root = {"proc/self/cgroup": "0::/elsewhere\n", "sys/fs/cgroup/cpu.max": "300000 100000\n"}
    assert devices.cgroup_cpus(_tree(tmp_path / "v2r", v2_root)) == 3  # a container sees its limit at its root
    v1 = {"proc/self/cgroup": "12:memory:/m\n4:cpu,cpuacct:/docker/abc\n0::/\n",
          "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
          "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
          "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"}
    assert devices.cgroup_cpus(_tree(tmp_path / "v1", v1)) == 1
    ancestor = {"proc/self/cgroup": "0::/user.slice/job.slice/run.scope\n",  # the quota on a parent slice
                "sys/fs/cgroup/user.slice/job.slice/cpu.max": "400000 100000\n",
                "sys/fs/cgroup/user.slice/job.slice/run.scope/cpu.max": "max 100000\n"}
    assert devices.cgroup_cpus(_tree(tmp_path / "anc", ancestor)) == 4
    named = {"proc/self/cgroup": "3:cpuset,cpu,cpuacct:/k8s/pod\n",  # a v1 mount named for all its controllers
             "sys/fs/cgroup/cpuset,cpu,cpuacct/k8s/pod/cpu.cfs_quota_us": "250000\n",
             "sys/fs/cgroup/cpuset,cpu,cpuacct/k8s/pod/cpu.cfs_period_us": "100000\n"}
    assert devices.cgroup_cpus(_tree(tmp_path / "named", named)) == 3
    unlimited = {"proc/self/cgroup": "1:cpu:/\n", "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
                 "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"}
    assert devices.cgroup_cpus(_tree(tmp_path / "none", unlimited)) is None
    garbled = {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "lots of cpus\n"}
    assert devices.cgroup_cpus(_tree(tmp_path / "bad", garbled)) is None
    assert devices.cgroup_cpus(str(tmp_path / "nothing-here")) is None
    assert devices.cores(_tree(tmp_path / "v1b", v1)) == 1 and devices.cores(str(tmp_path / "nothing-here")) >= 1
