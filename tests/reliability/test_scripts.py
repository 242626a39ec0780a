"""The shell scripts under the project's rules: a signal to a script reaches the child it is running (no stage, pip
or pytest outlives the script that started it), and setup installs into no environment it did not make."""
import os
import shutil
import signal
import subprocess
import time

import pytest

from conftest import REPO, offline_env, setup_checkout


def _gone(pid, timeout=15):
    end = time.time() + timeout
    while time.time() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_to_a_script_stops_the_child_it_runs(sig, tmp_path):
    # a script sourcing scripts/lib.sh, running a long child the way quickstart runs a stage (sent INT alone, as
    # `kill -INT` does, not the terminal's whole group)
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "long.sh"
    script.write_text(f'set -euo pipefail\n. "{REPO}/scripts/lib.sh"\n'
                      f'run bash -c \'echo $$ > "{pidfile}"; exec sleep 300\'\necho "not reached"\n')
    # started as from a terminal: a shell that inherits a signal ignored (nohup's HUP, a background job's INT) cannot
    # trap it, and this test may itself run under nohup
    def default_signals():
        for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)
    p = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, text=True, preexec_fn=default_signals)
    end = time.time() + 30
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.time() < end:
        time.sleep(0.05)
    child = int(pidfile.read_text())
    p.send_signal(sig)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 143 and "not reached" not in out
    assert _gone(child), "the child outlived the script"


def test_setup_refuses_a_venv_that_is_a_link(tmp_path):
    root, theirs = setup_checkout(tmp_path), tmp_path / "their-venv"
    (theirs / "bin").mkdir(parents=True)
    os.symlink(theirs, root / ".venv")
    p = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: .venv -> {theirs}: a link"), p.stderr
    assert os.listdir(theirs) == ["bin"] and not p.stdout


def test_setup_refuses_a_venv_it_did_not_make(tmp_path):
    root = setup_checkout(tmp_path)
    (root / ".venv" / "bin").mkdir(parents=True)  # someone's own environment, in the place setup would use
    p = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "exists and was not made by scripts/setup.sh" in lines[0], \
        p.stderr
    assert os.listdir(root / ".venv") == ["bin"]


def test_a_stop_between_the_child_s_start_and_its_record_still_reaches_it(tmp_path):
    """`run` starts the child, then records its pid: a signal that lands between the two (seen once on a loaded
    2-core machine: the child outlived the script and held its output open) still reaches the child, which the shell
    knows as its job from the fork. Here the child is started as `run` would, and the stop comes before the record."""
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "race.sh"
    script.write_text(f'set -euo pipefail\n. "{REPO}/scripts/lib.sh"\n'
                      f'bash -c \'echo $$ > "{pidfile}"; exec sleep 300\' &\n'
                      f'while [ ! -s "{pidfile}" ]; do sleep 0.05; done\nkill -TERM $$\nwait\necho "not reached"\n')
    p = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    assert p.returncode == 143 and "not reached" not in p.stdout, (p.returncode, p.stdout, p.stderr)
    child = int(pidfile.read_text())
    if not _gone(child):
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the child outlived the script")


def test_setup_names_what_it_cannot_install_without_the_network(tmp_path):
    """A bare Python (no torch) and an empty folder of wheels: one line naming the first requirement it cannot
    have and where it looked, exit 2, nothing converted."""
    import sys
    root = setup_checkout(tmp_path)
    shutil.copy(os.path.join(REPO, "requirements.txt"), root)
    (tmp_path / "wheels").mkdir()
    bare = subprocess.run([os.path.join(REPO, ".venv", "bin", "python"), "-c",
                           "import sys; print(sys._base_executable)"], capture_output=True, text=True).stdout.strip()
    env = {**offline_env(tmp_path / "wheels"), "EAGLE3_BASE_PYTHON": bare or sys.executable}
    p = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stdout + p.stderr
    assert lines[0].startswith("error: torch==2.13.0: setup cannot install it from ") and \
        str(tmp_path / "wheels") in lines[0] and "(pip: " in lines[0], lines[0]
    assert "lacks" not in p.stderr and not (root / "data").exists()
