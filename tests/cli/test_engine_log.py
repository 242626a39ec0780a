"""The engine's output goes to its log file (eagle3pipe/engines/engine.py): what a process started inside prints lands there
for good, our own stdout comes back after, and a link planted at the log's name is refused in one line, never
written through (no model: a plain child process stands for vLLM's workers)."""
import os
import subprocess
import sys


from eagle3pipe.engines import engine


def test_output_of_processes_started_inside_goes_to_the_log(tmp_path, capfd):
    log = tmp_path / "engine.log"
    with engine.engine_output(str(log)):
        os.write(2, b"noise from the parent\n")  # at the descriptor, as vLLM's C++ and its loggers write
        child = subprocess.Popen([sys.executable, "-c", "import sys, time; print('worker started', flush=True); "
                                  "time.sleep(0.5); print('ERROR 12-01 worker died: boom', file=sys.stderr)"])
    os.write(1, b"ours again\n")
    child.wait(timeout=30)
    out, err = capfd.readouterr()
    text = log.read_text()
    assert "ours again" in out and "noise" not in out + err and "worker" not in out + err
    assert text.startswith("==== ") and "noise from the parent" in text and "worker started" in text
    assert "worker died" in text  # written after the block ended: the child kept the file
    assert engine.last_error(str(log)) == "ERROR 12-01 worker died: boom"
