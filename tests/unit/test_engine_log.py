"""The engine's output goes to its log file (eagle3pipe/engine.py): what a process started inside prints lands there
for good, our own stdout comes back after, and a link planted at the log's name is refused in one line, never
written through (no model: a plain child process stands for vLLM's workers)."""
import os

import pytest

from eagle3pipe import engine
from eagle3pipe.cli import RunError


def test_a_link_at_the_logs_name_is_refused_not_followed(tmp_path):
    victim = tmp_path / "notes.txt"
    victim.write_text("a person's notes\n")
    link = tmp_path / "engine.log"
    link.symlink_to(victim)
    with pytest.raises(RunError) as e:
        with engine.engine_output(str(link)):
            pass
    assert "(a link)" in str(e.value) and "\n" not in str(e.value)
    assert victim.read_text() == "a person's notes\n" and os.path.islink(link)
