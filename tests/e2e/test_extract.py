"""Stage 02 end to end: both backends on real SmolLM2 + ShareGPT rows, speculators reading the files, resume and
--overwrite, resume after SIGKILL, injected OOM / NaN faults inside the real loop, and the nohup launcher."""
import json
import os
import signal
import subprocess
import sys
import time

from safetensors.torch import load_file
import torch

from conftest import REPO, assert_refused, extract, rows_of, run_script


def test_hf_backend_files_and_speculators_reads_them(hf_out, prep):
    from hs_connectors import FileTransfer
    from speculators.data_generation.offline import check_hidden_states
    rows = rows_of(prep)
    man = json.load(open(hf_out / "manifest.json"))
    assert man["layer_ids"] == [2, 15, 27, 30] and man["complete"] and man["counts"]["ok"] == len(rows)
    assert "before the final norm" in man["layer_id_convention"]
    ft = FileTransfer(hf_out)
    for i, r in enumerate(rows):
        data = ft.get_cached(i)
        check_hidden_states(data, r["input_ids"])
        assert data["hidden_states"].shape == (len(r["input_ids"]), 4, 576)
        assert data["hidden_states"].dtype == torch.bfloat16
    assert not [n for n in os.listdir(hf_out) if n.startswith(".hs_") or n == ".incoming"]


def test_layer_ids_match_the_convention(hf_out, prep, model_path):
    """id k = input of layer k = HF output_hidden_states[k]; id n = last layer output before the final norm."""
    from transformers import AutoModelForCausalLM
    dtype = json.load(open(hf_out / "manifest.json"))["compute_dtype"]  # the reference in the dtype stage 02 used
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([rows_of(prep)[0]["input_ids"]])
    captured = {}
    model.model.layers[-1].register_forward_hook(lambda m, a, o: captured.setdefault("last", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    ours = load_file(hf_out / "hs_0.safetensors")["hidden_states"].float()

    def rel(a, b):  # the file came from a padded batch: equal up to bf16 rounding
        return ((a - b.float()).norm() / b.float().norm()).item()
    for slot, k in enumerate([2, 15, 27]):
        err = rel(ours[:, slot], hs[k][0])
        assert err < 0.01
        assert err * 3 < min(rel(ours[:, slot], hs[k - 1][0]), rel(ours[:, slot], hs[k + 1][0]))  # no off-by-one
    err = rel(ours[:, 3], captured["last"][0])
    assert err < 0.03 and err * 3 < rel(ours[:, 3], hs[29][0])
    assert rel(ours[:, 3], hs[30][0]) > 0.5  # HF's last entry is after the final norm: not id n


def test_rerun_resumes_and_overwrite(hf_out, prep, model_path):
    before = {n: os.path.getmtime(hf_out / n) for n in os.listdir(hf_out) if n.startswith("hs_")}
    p, _ = extract(model_path, prep, hf_out, "--backend", "hf")
    assert p.returncode == 0, p.stderr
    n = len(rows_of(prep))
    assert f"{n} of {n} samples already extracted" in p.stderr
    assert before == {n: os.path.getmtime(hf_out / n) for n in before}
    for extra in ([], ["--dry-run"]):  # the dry run catches it too, before any model would load
        p, secs = extract(model_path, prep, hf_out, "--backend", "hf", "--layer-ids", "3,15,27", *extra)
        assert_refused(p, secs, "holds hidden states of another run", "layer_ids", "--overwrite")


def test_kill_mid_run_then_resume(prep, model_path, tmp_path):
    out = tmp_path / "hs"
    cmd = [sys.executable, "02_extract_hidden_states.py", "--backend", "hf", "--model-path", model_path,
           "--prepared-data", str(prep), "--output-dir", str(out), "--max-seq-len", "256", "--batch-size", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len([n for n in os.listdir(out) if n.startswith("hs_")] if out.exists() else []) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    got = [n for n in os.listdir(out) if n.startswith("hs_")]
    n = len(rows_of(prep))
    assert 3 <= len(got) < n and not (out / "manifest.json").exists()
    # a truncated file under a final name (as a foreign tool or a dying disk might leave) is found and redone
    victim = out / got[0]
    st = os.stat(victim)
    victim.write_bytes(victim.read_bytes()[:100])
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # a dying disk's truncation: the file's own time
    p, _ = run_script(*cmd[1:])
    assert p.returncode == 0, p.stderr
    assert "unreadable" in p.stderr and "will be extracted again" in p.stderr
    man = json.load(open(out / "manifest.json"))
    assert man["counts"]["ok"] == n and man["counts"]["resumed"] == len(got) - 1
    from speculators.data_generation.offline import check_hidden_states
    for i, r in enumerate(rows_of(prep)):
        check_hidden_states(load_file(out / f"hs_{i}.safetensors"), r["input_ids"])


def test_injected_oom_splits_batches_and_nan_fails_one_row(prep, model_path, tmp_path):
    rows = rows_of(prep)
    lengths = sorted(len(r["input_ids"]) for r in rows)
    limit = lengths[-2] - 1  # only the longest two rows cannot fit, even alone
    out = tmp_path / "hs"
    p, _ = extract(model_path, prep, out, "--backend", "hf", "--batch-size", "4",
                   env={"EAGLE3_INJECT_OOM_ABOVE_TOKENS": str(limit), "EAGLE3_INJECT_NAN_ROWS": "5"})
    assert p.returncode == 1, p.stderr
    assert p.stderr.count("verifier loaded") == 1  # never reloaded
    assert "retrying as 2 + 2" in p.stderr
    man = json.load(open(out / "manifest.json"))
    too_long = {str(i) for i, r in enumerate(rows) if len(r["input_ids"]) > limit}
    expected = too_long | {"5"}
    assert set(man["failures"]) == expected and not man["complete"]
    assert man["failures"]["5"] == "non-finite values" or "5" in too_long
    for i in range(len(rows)):
        assert (out / f"hs_{i}.safetensors").exists() == (str(i) not in expected)


def test_vllm_backend_matches_hf(prep, hf_out, model_path, tmp_path):
    """vLLM computing in float32 against the HF backend in auto's dtype (bf16 where it is native, float32 elsewhere):
    the files agree within bf16 rounding either way, and are stored bf16. The engine's own output goes to its log."""
    out = tmp_path / "hs"
    p, _ = extract(model_path, prep, out, "--backend", "vllm", "--dtype", "float32")
    assert p.returncode == 0, p.stderr[-3000:]
    man = json.load(open(out / "manifest.json"))
    assert man["compute_dtype"] == "float32" and man["storage_dtype"] == "bf16"
    # what the operator reads is ours: vLLM's start-up logs, Triton notices and warnings are in engine.log
    log = (out / "engine.log").read_text()
    assert "non-default args" in log and "'dtype': 'float32'" in log
    for noise in ("non-default args", "Triton", "EngineCore", "WARNING 1"):
        assert noise not in p.stderr + p.stdout, (noise, p.stderr[-3000:])
    assert f"its output goes to {out}/engine.log" in p.stderr
    for i, r in enumerate(rows_of(prep)):
        a, b = load_file(out / f"hs_{i}.safetensors"), load_file(hf_out / f"hs_{i}.safetensors")
        assert a["token_ids"].tolist() == r["input_ids"]
        ha, hb = a["hidden_states"].float(), b["hidden_states"].float()
        assert ha.shape == hb.shape
        rel = [((ha[:, k] - hb[:, k]).norm() / hb[:, k].norm()).item() for k in range(4)]
        assert max(rel[:3]) < 0.02 and rel[3] < 0.05, rel
    assert not (out / ".incoming").exists()


def test_extract_sh_preflight_then_nohup(prep, model_path, tmp_path):
    out = tmp_path / "hs"
    base = ["bash", "scripts/extract.sh", "--model-path", model_path, "--prepared-data", str(prep),
            "--output-dir", str(out), "--max-seq-len", "256"]
    # a bad flag stops in the foreground preflight: nothing started, nothing written
    p = subprocess.run(base + ["--backend", "hf", "--batch-size", "0"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "error: --batch-size 0" in p.stderr and not out.exists()
    # the launcher's default TP 8 (vLLM) is refused on a machine without GPUs, before anything starts
    p = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--tp-size 8" in p.stderr and not out.exists()
    p = subprocess.run(base + ["--backend", "hf"], cwd=REPO, capture_output=True, text=True,  # no default TP for hf
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert f"tail -f {out}/extract.log" in p.stdout and "plan:" in p.stdout
    pid = int((out / "extract.pid").read_text())
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    log = (out / "extract.log").read_text()
    assert "done:" in log and (out / "manifest.json").exists(), log[-2000:]
    assert json.load(open(out / "manifest.json"))["complete"]
