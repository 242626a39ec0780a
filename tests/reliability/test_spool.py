"""A shared --engine-spool (a folder the stage does not own): only the files the engine made for this run, and
their locks, are deleted there (eagle3pipe/formats/spool.py); a person's file of any name stays, whatever an engine names.
The stage's side runs in a process started after the person's files were made, as stage 04 would be."""
import subprocess
import sys
import time

import torch

from conftest import REPO
from eagle3pipe.formats.hidden_states import save

STAGE = """
import os, sys, torch
sys.path.insert(0, {repo!r})
from eagle3pipe.storage import outdir
from eagle3pipe.formats.spool import clear_spool, remove_spool_file, wait_for_engine_file
from eagle3pipe.formats.hidden_states import save
spool = sys.argv[1]
states = {{"hidden_states": torch.zeros(3, 2, 4, dtype=torch.bfloat16), "token_ids": torch.tensor([1, 2, 3])}}
# what this run's engine writes (the connector: the file, then its lock released), then names in its answers
mine = os.path.join(spool, "req-7.safetensors")
save(mine, states)
open(mine + ".lock", "w").close()
for name in ("req-7.safetensors", "important.safetensors", "old-states.safetensors", "notes.txt"):
    path = os.path.join(spool, name)  # an engine's answer, honest or not
    if wait_for_engine_file(path, spool):
        remove_spool_file(spool, path)
print(clear_spool(spool))
"""


def test_a_person_s_files_in_a_shared_spool_stay(tmp_path):
    spool = tmp_path / "shared"
    spool.mkdir()
    states = {"hidden_states": torch.zeros(3, 2, 4, dtype=torch.bfloat16), "token_ids": torch.tensor([1, 2, 3])}
    save(str(spool / "important.safetensors"), {"weight": torch.ones(4)})
    (spool / "important.safetensors.lock").write_bytes(b"")
    save(str(spool / "old-states.safetensors"), states)  # in the engine's own format, but there before the run
    (spool / "old-states.safetensors.lock").write_bytes(b"")
    (spool / "notes.txt").write_text("mine\n")
    (spool / "stray.safetensors.lock").write_bytes(b"")  # a lock beside nothing
    before = {p.name: p.read_bytes() for p in spool.iterdir()}
    time.sleep(1.5)  # the stage starts after them (spool.SKEW: a file server's clock may lag by 1 s)
    script = tmp_path / "stage.py"
    script.write_text(STAGE.format(repo=REPO))
    p = subprocess.run([sys.executable, str(script), str(spool)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    after = {p.name: p.read_bytes() for p in spool.iterdir()}
    assert after == before  # this run's engine file and its lock went; everything a person had there is unchanged
