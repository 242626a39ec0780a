"""Stage 01 --regenerate through its command line with the real verifier in vLLM (CPU): every assistant turn is
rewritten by the verifier, the loss masks cover the new answers, a SIGKILLed run keeps what it generated and a
rerun asks only for the rest; the manifest records what was regenerated."""
import json
import os
import signal
import subprocess
import sys


from conftest import REPO, run_script


def test_regenerate_resumes_after_a_kill(model_path, tokenizer, tmp_path):
    data = tmp_path / "d.jsonl"
    with open(data, "w") as f:
        for k in range(4):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"Name a colour, please ({k})."},
                {"role": "assistant", "content": f"ORIGINAL ANSWER {k}a"},
                {"role": "user", "content": "And a fruit?"},
                {"role": "assistant", "content": f"ORIGINAL ANSWER {k}b"}]}) + "\n")
        # ShareGPT has conversations that open with the assistant: that turn answers nothing and is dropped
        f.write(json.dumps({"messages": [
            {"role": "assistant", "content": "ORIGINAL GREETING"},
            {"role": "user", "content": "Name an animal."},
            {"role": "assistant", "content": "ORIGINAL ANSWER 4a"}]}) + "\n")
    out = tmp_path / "prep"
    argv = ["01_prepare_dataset.py", "--model-path", model_path, "--dataset", str(data), "--output-dir", str(out),
            "--max-seq-len", "256", "--regenerate", "--regen-max-tokens", "12", "--regen-batch-size", "2"]
    # SIGKILL after the second vLLM call. Its own session: vLLM's engine processes outlive a SIGKILLed parent for a
    # while, holding its output pipes; the test reaps the whole group
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=log, stderr=log, start_new_session=True,
                            env=dict(os.environ, EAGLE3_INJECT_KILL="regen:2"))
    assert proc.wait(timeout=600) == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-2000:]
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    cache = out / ".regenerating.jsonl"
    assert len(cache.read_text().splitlines()) == 4 and not (out / "manifest.json").exists()

    p, _ = run_script(*argv)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "regenerated 5 assistant turns (4 from an earlier run)" in p.stderr, p.stderr
    m = json.load(open(out / "manifest.json"))
    assert m["regenerated"]["turns_regenerated"] == 5 and m["regenerated"]["turns_from_cache"] == 4
    assert m["regenerated"]["opening_turns_dropped"] == 1
    assert m["regenerated"]["settings"]["max_tokens"] == 12 and not cache.exists()
    answers = [json.loads(l) for l in open(out / "regenerated.jsonl")]
    assert sorted((a["id"], a["turn"]) for a in answers) == [(f"row{k}", t) for k in range(4) for t in (0, 1)] + [("row4", 0)]
    for line in open(out / "tokenized_data.jsonl"):  # the loss covers the verifier's answers, not the originals
        r = json.loads(line)
        trained = tokenizer.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m])
        assert "ORIGINAL" not in trained and len(trained.strip()) > 0
        ours = [a["text"] for a in answers if a["id"] == r["id"]]
        assert all(a.strip()[:8] in trained for a in ours if a.strip())
