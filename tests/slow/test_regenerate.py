"""Stage 01 --regenerate through vLLM on CPU: resumed after a kill from the answers already generated, and with
sampling over real ShareGPT rows. Not in the default set (each starts vLLM's engine two or three times)."""
import json
import os
import signal
import subprocess
import sys

from conftest import REPO, regen_records, run_script


# a regression run over 40 real conversations
def test_regenerate_samples_on_cpu_over_real_sharegpt(model_path, tmp_path):
    """Sampling (temperature > 0) on 40 real ShareGPT conversations: their long prompts are prefilled in chunks,
    and per-request seeds made vLLM's CPU engine die ("CPU Generator does not use offset"). Split ShareGPT parts
    that open with an assistant turn are dropped and counted."""
    out = tmp_path / "prep"
    p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "40", "--output-dir",
                      str(out), "--regenerate", "--regen-temperature", "0.7", "--regen-max-tokens", "4")
    assert p.returncode == 0, p.stderr[-2000:]
    m = json.load(open(out / "manifest.json"))["regenerated"]
    assert m["settings"]["temperature"] == 0.7 and m["turns_regenerated"] > 40 and m["opening_turns_dropped"] > 0
    assert len(open(out / "regenerated.jsonl").readlines()) == m["turns_regenerated"]


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


def test_transformers_and_vllm_give_the_same_greedy_answers_where_their_arithmetic_agrees(model_path, tmp_path):
    """--regen-engine hf against vllm on the embedded verifier, greedy, both in float32 on this CPU, over real
    ShareGPT prompts: most answers are the same text; where one is not, both agree up to the first token the two
    engines' float32 arithmetic (vLLM's fused CPU kernels, transformers' eager ones) ranks otherwise, where two
    candidates' logits are within a rounding of each other. The test prints where each pair parts."""
    answers = {}
    for eng in ("vllm", "hf"):
        out = tmp_path / eng
        p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "12", "--output-dir",
                          str(out), "--regenerate", "--regen-engine", eng, "--regen-max-tokens", "32",
                          "--dtype", "float32", "--max-seq-len", "512")
        assert p.returncode == 0, p.stderr[-2000:]
        answers[eng] = {(r["id"], r["turn"]): r["text"] for r in map(json.loads, open(out / "regenerated.jsonl"))}
    # a later turn's prompt holds the earlier answers: compare each conversation's first turn only
    firsts = sorted(k for k in answers["vllm"] if k[1] == 0)
    assert firsts and set(firsts) <= set(answers["hf"])
    same = [k for k in firsts if answers["vllm"][k] == answers["hf"][k]]
    for k in firsts:
        a, b = answers["vllm"][k], answers["hf"][k]
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"{k}: {'same' if a == b else f'part at character {n}: {a[n:n + 20]!r} / {b[n:n + 20]!r}'}")
    assert len(same) >= 0.75 * len(firsts), (len(same), len(firsts))


def test_several_sampled_answers_are_rows_of_their_own_and_never_twice(model_path, tmp_path):
    data, out = regen_records(tmp_path / "d.jsonl", n=2), tmp_path / "prep"
    base = ["01_prepare_dataset.py", "--model-path", model_path, "--dataset", str(data), "--output-dir", str(out),
            "--max-seq-len", "256", "--regenerate", "--regen-engine", "hf", "--regen-max-tokens", "8"]
    p, _ = run_script(*base, "--regen-samples", "3")
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and lines == [lines[-1]] and "--regen-samples 3: at --regen-temperature 0 every " \
        "sample is the same greedy answer" in lines[0] and not out.exists(), p.stderr[-2000:]
    p, _ = run_script(*base, "--regen-samples", "3", "--regen-temperature", "1.0")
    assert p.returncode == 0, p.stderr[-2000:]
    m = json.load(open(out / "manifest.json"))
    rows = [json.loads(line)["id"] for line in open(out / "tokenized_data.jsonl")]
    assert len(rows) == len(set(rows)) == 9 - m["regenerated"]["duplicate_samples"], (rows, m["regenerated"])
    assert {r.split("#")[0] for r in rows} == {"row0", "row1", "row2"} and any("#sample2" in r for r in rows)
