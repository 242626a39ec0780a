"""Moved from the default set to keep it within its 15 minutes (tests/cli/test_evaluate.py); docs/TESTS.md
says what the default set still proves of it."""
import json
import os

from conftest import run_script, snapshot


def test_dry_run_checks_every_checkpoint_and_the_prompt_lengths_then_stops(model_path, stages, trained, tmp_path):
    """--dry-run runs every check of a real run (each epoch's config and weights' headers, the flags, the prompts'
    lengths through the tokenizer) and stops: vLLM never imported, nothing written. Prompts too long for the verifier's
    positions with --max-new-tokens are one line, before the output folder is taken."""
    out, _ = trained
    before = snapshot(out)
    common = ["05_evaluate.py", "--model-path", model_path, "--prepared-data", str(stages["prepared"]),
              "--num-prompts", "3", "--output-dir", str(tmp_path / "ev")]
    p, _ = run_script(*common, "--draft", str(out), "--dry-run")
    assert p.returncode == 0, p.stderr[-3000:]
    epochs = sorted(n for n in os.listdir(out) if n.isdigit())
    assert f"dry run: {len(epochs)} checkpoint(s) checked ({', '.join(epochs)})" in p.stdout, p.stdout
    assert "vllm" not in p.heavy and "speculators" not in p.heavy, p.heavy
    from eagle3pipe.base import compute  # without --dtype, the engines would compute in auto's dtype for this machine
    assert f"compute dtype: {compute.resolve('auto', on_gpu=False).dtype}" in p.stdout, p.stdout
    # 8180 new tokens pass the check without prompts (8180 + 3 + 1 <= 8192); the prompts' own tokens do not fit
    p, _ = run_script(*common, "--draft", str(out / "last"), "--max-new-tokens", "8180")
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("error: --max-new-tokens 8180: the longest prompt (") and "8192" in lines[0], lines
    assert "the longest: " in lines[0], lines  # the record, to find it
    assert "vllm" not in p.heavy, p.heavy
    # a prompt longer than the verifier's positions: no --max-new-tokens can help, so the line names the record;
    # this one (5 MB) by its characters alone, before any tokenizing (tokens decide nearer the limit:
    # unit/test_rules.py::test_prompts_that_leave_no_room_for_an_answer_are_refused_by_their_tokens)
    huge = tmp_path / "huge.jsonl"
    huge.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "word " * 1_000_000}]}) + "\n")
    p, _ = run_script(*common, "--draft", str(out / "last"), "--prompts", str(huge), "--dry-run")
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith(f"error: --prompts {huge}:2: a prompt of at least ") and "characters)" in lines[0] \
        and "leave no room" in lines[0], lines
    # fewer usable prompts than --num-prompts: one warning line, and the run goes on with those
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"messages": [{"role": "assistant", "content": "Hello!"},
                                                    {"role": "user", "content": f"Question {i}?"}]}) + "\n"
                           for i in range(2)))
    p, _ = run_script(*common, "--draft", str(out / "last"), "--prompts", str(few), "--dry-run")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"--num-prompts 3: {few} holds 2 usable prompts after the first 0 records" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "ev").exists() and snapshot(out) == before
