"""Stage 05 through its command line: refusals before any model loads, and which prompts are held out."""
import json
import shutil

import pytest

from conftest import assert_refused, run_script
from eagle3pipe.base.devices import visible_gpus


def test_refusals(model_path, stages, trained, tmp_path):
    out, _ = trained
    not_eagle = tmp_path / "not-eagle"
    not_eagle.mkdir()
    json.dump({"speculators_model_type": "mtp"}, open(not_eagle / "config.json", "w"))
    wrong_size = tmp_path / "wrong-size"
    wrong_size.mkdir()
    cfg = json.load(open(out / "last" / "config.json"))
    cfg["transformer_layer_config"]["hidden_size"] = 4096
    json.dump(cfg, open(wrong_size / "config.json", "w"))
    other_prep = tmp_path / "other-prep"  # another stage 01 run's output (its content differs from the draft's)
    shutil.copytree(stages["prepared"], other_prep)
    man = json.load(open(other_prep / "manifest.json"))
    man["content_id"] = "0" * 16
    json.dump(man, open(other_prep / "manifest.json", "w"))
    cases = [
        (["--draft", str(tmp_path / "nope")], ["--draft", "nope: not found"]),
        (["--draft", str(out / "last" / "config.json")], ["--draft", "config.json: a file; give the checkpoint's folder"]),
        (["--draft", str(not_eagle.parent)], ["--draft", "no config.json"]),  # a folder, not a checkpoint
        (["--draft", str(not_eagle)], ["not an eagle3 speculators checkpoint"]),
        (["--draft", str(wrong_size)], ["hidden size 4096", "576"]),
        (["--batch-sizes", "0"], ["--batch-sizes [0]"]),
        (["--batch-sizes", "x"], ["--batch-sizes", "integers"]),
        (["--prompts", str(tmp_path / "none.jsonl")], ["--prompts", "no such file"]),
        (["--num-prompt", "3"], ["did you mean --num-prompts"]),
        # nothing goes inside an input: the stage 04 folder holding the draft, or stage 01's
        (["--output-dir", str(out / "ev")], ["--output-dir", "is inside the input --draft"]),
        (["--prepared-data", str(stages["prepared"]), "--output-dir", str(stages["prepared"] / "ev")],
         ["is inside the input --prepared-data"]),
        # a --prepared-data that is not stage 01's cannot say which prompts were trained on: refused, not guessed
        (["--prepared-data", str(stages["hs"])], ["--prepared-data", "is the output of stage 'extract'"]),
        (["--prepared-data", str(tmp_path / "prepraed")], ["--prepared-data", "prepraed: not found; give stage 01's"]),
        (["--prepared-data", str(other_prep)], ["not the stage 01 output --draft", "last trained on", "give it"]),
        (["--draft", str(out / "last"), str(out / "last")], ["named twice"]),
        # the flags against the verifier's positions and the device, before any draft or prompt is read
        (["--num-speculative-tokens", "1000000"], ["--num-speculative-tokens 1000000", "at most 32"]),
        (["--max-new-tokens", "1000000"], ["--max-new-tokens 1000000", "the verifier handles 8192"]),
        # no round of drafting fits: both engines loaded, then an acceptance of None and a speed-up of 2 tokens
        (["--max-new-tokens", "4"], ["--max-new-tokens 4: with --num-speculative-tokens 3", "at least 5"]),
        (["--batch-sizes", "1,100000"], ["--batch-sizes [1, 100000]", "at most 4096"]),
        (["--num-prompts", "10000000"], ["--num-prompts 10000000", "at most 100000"]),
    ] + ([] if visible_gpus() else [(["--tp-size", "4"], ["--tp-size 4: no GPU visible"])])
    for extra, needles in cases:
        p, secs = run_script("05_evaluate.py", "--model-path", model_path, "--draft", str(out / "last"),
                             *(["--output-dir", str(tmp_path / "ev")] if "--output-dir" not in extra else []), *extra)
        assert_refused(p, secs, *needles)


def test_prompts_are_held_out(stages):
    import argparse
    from eagle3pipe.chat import conversations, heldout, messages
    man = json.load(open(stages["prepared"] / "manifest.json"))
    skip = man["counts"]["records_read"]
    args = argparse.Namespace(prompts="sharegpt", num_prompts=5)
    prompts = heldout.select_prompts(args, skip)
    trained_firsts = set()
    for i, (where, rec) in enumerate(conversations.iter_records("sharegpt")):
        if i >= skip:
            break
        _, msgs = messages.normalize(where, rec)
        trained_firsts.update(m["content"] for m in msgs if m["role"] == "user")
    assert len(prompts) == 5
    for p in prompts:
        assert p[-1]["role"] == "user" and p[-1]["content"] not in trained_firsts


def test_the_training_records_are_skipped_however_the_source_is_spelled(stages, trained, tmp_path, monkeypatch):
    """Stage 01's records are skipped when --prompts names the same source, relative or absolute, from wherever each
    stage ran; the default stage 01 folder absent is a warning that says evaluation starts at the first record, a
    folder given that does not exist is refused."""
    from eagle3pipe.chat import heldout
    man = json.load(open(stages["prepared"] / "manifest.json"))
    assert heldout.held_out_skip("sharegpt", str(stages["prepared"])) == (man["counts"]["records_read"], None)
    monkeypatch.chdir(tmp_path)  # no data/prepared here: the default folder absent is a warning
    skip, warning = heldout.held_out_skip("sharegpt", heldout.PREPARED_DEFAULT)
    assert skip == 0 and "evaluating from the first record" in warning
    # unless the draft's own stage 04 manifest names the stage 01 output it trained on: that one's records are skipped
    # (its content id checked), where evaluation started at the first training record with a warning
    out, _ = trained
    skip, warning = heldout.held_out_skip("sharegpt", heldout.PREPARED_DEFAULT, [("last", str(out / "last"))])
    assert skip == man["counts"]["records_read"] and "using" in warning and "the draft trained on" in warning, warning
    with pytest.raises(heldout.UsageError, match=r"^--prepared-data \S+/prepraed: not found; give stage 01's"):
        heldout.held_out_skip("sharegpt", str(tmp_path / "prepraed"))  # a path given is a typo, not a default
    data = tmp_path / "ds" / "chats.jsonl"
    data.parent.mkdir()
    data.write_text("")
    prep = tmp_path / "prep"
    shutil.copytree(stages["prepared"], prep)
    m = json.load(open(prep / "manifest.json"))
    m["args"]["dataset"], m["cwd"] = "ds/chats.jsonl", str(tmp_path)  # stage 01 ran in tmp_path with a relative path
    json.dump(m, open(prep / "manifest.json", "w"))
    monkeypatch.chdir(data.parent)
    assert heldout.held_out_skip("chats.jsonl", str(prep))[0] == m["counts"]["records_read"]
    assert heldout.held_out_skip(str(data), str(prep))[0] == m["counts"]["records_read"]
    assert heldout.held_out_skip("sharegpt", str(prep))[0] == 0  # another source: nothing of it was trained on
    # stage 01 read the first 7 records of a folder (a.jsonl's 4, then 3 of b.jsonl's 5): --prompts naming one
    # file of it skips what was read of that file; a folder holding the dataset among other records is refused
    rec = json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n"
    folder = tmp_path / "chats"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jsonl").write_text(rec * 4)
    (folder / "sub" / "b.jsonl").write_text(rec * 5)
    m["args"]["dataset"], m["counts"]["records_read"] = str(folder), 7
    json.dump(m, open(prep / "manifest.json", "w"))
    assert heldout.held_out_skip(str(folder / "a.jsonl"), str(prep)) == (4, None)
    assert heldout.held_out_skip(str(folder / "sub" / "b.jsonl"), str(prep)) == (3, None)
    assert heldout.held_out_skip(str(folder / "sub"), str(prep)) == (3, None)
    assert heldout.held_out_skip(str(folder), str(prep)) == (7, None)
    from eagle3pipe.base.errors import UsageError
    with pytest.raises(UsageError, match="holds the dataset stage 01 trained on"):
        heldout.held_out_skip(str(tmp_path), str(prep))


def test_a_training_log_cut_short_is_named_not_fatal(trained, tmp_path):
    from eagle3pipe.evaluate import evaluation
    out, _ = trained
    copy = tmp_path / "ck"
    shutil.copytree(out, copy, symlinks=True)
    whole, warning = evaluation.read_train_metrics(str(copy / "last"))
    assert whole and warning is None
    with open(copy / "logs" / "metrics.jsonl", "a") as f:
        f.write('{"train": {"loss": ')
    records, warning = evaluation.read_train_metrics(str(copy / "last"))
    assert records == whole and "metrics.jsonl: 1 lines are not JSON records" in warning


def test_several_drafts_are_named_by_their_run(model_path, trained, tmp_path):
    """--draft A B: every checkpoint of both, each named '<run folder>/<epoch>', so the ranking tells them apart."""
    import os
    from eagle3pipe.evaluate import evaluation
    from eagle3pipe.verifier import verifier
    out, _ = trained
    other = tmp_path / "other-run"
    shutil.copytree(out, other, symlinks=True)
    fp, tc = verifier.open_verifier(model_path, False)
    found, _ = evaluation.drafts_to_measure([str(out / "last"), str(other)], fp, tc)
    last = os.path.basename(os.path.realpath(out / "last"))
    epochs = sorted(n for n in os.listdir(other) if n.isdigit())
    assert [n for n, _ in found] == [f"{out.name}/{last}"] + [f"other-run/{e}" for e in epochs]
    # two runs whose folders share a name (runs/a/checkpoints, runs/b/checkpoints) are told apart by the folder above
    for run in ("a", "b"):
        shutil.copytree(out, tmp_path / "runs" / run / "checkpoints", symlinks=True)
    found, _ = evaluation.drafts_to_measure([str(tmp_path / "runs" / r / "checkpoints" / "last") for r in "ab"], fp, tc)
    assert [n for n, _ in found] == [f"a/checkpoints/{last}", f"b/checkpoints/{last}"]


def test_a_prompt_is_the_first_user_turn_after_any_system_turn(tmp_path):
    import argparse
    from eagle3pipe.chat import heldout
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "assistant", "content": "Hello, how can I help?"},
                                             {"role": "user", "content": "Name a color."},
                                             {"role": "assistant", "content": "Blue."}]}) + "\n")
    wheres = []
    got = heldout.select_prompts(argparse.Namespace(prompts=str(data), num_prompts=5), 0, wheres)
    assert got == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]]
    assert wheres == [f"{data}:1"]
    # what follows the prompt is not read: a later tool call, malformed here (no function), does not cost the record
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Weather in Paris?"},
                                             {"role": "assistant", "content": None,
                                              "tool_calls": [{"id": "1", "type": "function"}]},
                                             {"role": "function", "content": "sunny"}]}) + "\n")
    assert heldout.select_prompts(argparse.Namespace(prompts=str(data), num_prompts=5), 0) == [
        [{"role": "user", "content": "Weather in Paris?"}]]
    # a record that offers tools: its prompt carries them, as its training rows did (the template writes them)
    weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    data.write_text(json.dumps({"tools": weather, "messages": [{"role": "user", "content": "Weather in Paris?"}]})
                    + "\n" + json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    tools = []
    assert len(heldout.select_prompts(argparse.Namespace(prompts=str(data), num_prompts=5), 0, tools=tools)) == 2
    assert tools == [weather, None]


def test_a_copy_of_the_training_records_under_another_path_is_not_taken_as_held_out(stages, trained, model_path,
                                                                                     tmp_path):
    """The held-out rule is by source and position: the first records of the embedded ShareGPT saved as a file of
    their own were all evaluated as held-out prompts. Records carrying the ids stage 01 trained on are skipped, and
    said so."""
    from eagle3pipe.chat import conversations
    out, _ = trained
    trained_n = json.load(open(stages["prepared"] / "manifest.json"))["counts"]["records_read"]
    source = (rec for _, rec in conversations.iter_records("sharegpt"))
    records = [rec for _, rec in zip(range(trained_n + 40), source)]
    argv = ["05_evaluate.py", "--model-path", model_path, "--draft", str(out / "last"), "--prepared-data",
            str(stages["prepared"]), "--prompts", str(tmp_path / "copy.jsonl"), "--num-prompts", "4", "--output-dir",
            str(tmp_path / "ev"), "--dry-run"]
    (tmp_path / "copy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    p, _ = run_script(*argv)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "records carry the ids of records stage 01 trained on (a copy of its data?); skipped" in p.stderr, \
        p.stderr[-2000:]
    (tmp_path / "copy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:trained_n]))
    p, secs = run_script(*argv)  # nothing but training records: refused, saying why
    assert_refused(p, secs, "no usable prompt", "that carry the ids of records stage 01 trained on")
