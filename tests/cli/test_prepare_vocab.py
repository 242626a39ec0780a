"""Stages 01 and 03 through their command lines: outputs, manifests, resume/overwrite, and every bad input
refused with exit 2, one `error:` line naming the flag/file/record, in under 3 seconds."""
import json
import os

import numpy as np
import pytest

from conftest import loaded_nothing, model_with_template, run_script

GOOD = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, model_path):
    out = tmp_path_factory.mktemp("s01") / "prepared"
    p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--dataset", "sharegpt",
                      "--num-samples", "40", "--max-seq-len", "512", "--output-dir", str(out))
    assert p.returncode == 0, p.stderr
    return out


def test_prepare_outputs_agree(prepared, tokenizer):
    rows = [json.loads(line) for line in open(prepared / "tokenized_data.jsonl")]
    man = json.load(open(prepared / "manifest.json"))
    freq = np.load(prepared / "token_freq.npy")
    assert man["stage"] == "prepare" and man["counts"]["rows"] == len(rows) > 20
    assert man["counts"]["records_read"] == 40
    assert sum(man["counts"]["skipped"].values()) + len(rows) == 40
    assert man["verifier"]["num_hidden_layers"] == 30 and man["verifier"]["vocab_size"] == 49152
    assert freq.dtype == np.int64 and freq.shape == (49152,)
    counts = np.zeros(49152, dtype=np.int64)
    for r in rows:
        assert set(r) == {"id", "input_ids", "loss_mask"}
        assert len(r["input_ids"]) == len(r["loss_mask"]) <= 512
        ids, m = np.array(r["input_ids"]), np.array(r["loss_mask"], dtype=bool)
        counts += np.bincount(ids[m], minlength=49152)
        # every trained run starts right after "<|im_start|>assistant\n"
        starts = np.flatnonzero(m & ~np.r_[False, m[:-1]])
        for s in starts:
            assert tokenizer.decode(ids[max(0, s - 4):s]).endswith("<|im_start|>assistant\n")
    assert np.array_equal(counts, freq)
    assert man["counts"]["loss_tokens"] == int(freq.sum())


def test_prepare_is_deterministic_and_replaces_its_own_output(prepared, model_path, tmp_path):
    """The same rows again, byte for byte, from worker processes (--num-workers 2, in chunks of 5 conversations
    whose results arrive out of order) as from one."""
    before = (prepared / "tokenized_data.jsonl").read_bytes()
    content_id = json.load(open(prepared / "manifest.json"))["content_id"]
    p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "40",
                      "--max-seq-len", "512", "--num-workers", "2", "--output-dir", str(prepared))
    assert p.returncode == 0, p.stderr
    assert "in 2 worker processes" in p.stderr
    assert (prepared / "tokenized_data.jsonl").read_bytes() == before
    assert json.load(open(prepared / "manifest.json"))["content_id"] == content_id
    # replaced file by file in place: no temporary file left, nothing made beside the folder
    assert not [n for n in os.listdir(prepared) if ".tmp-" in n] and os.listdir(prepared.parent) == ["prepared"]


def test_vocab_map(prepared, tmp_path):
    # a folder whose name carries another size (a config's vocab_mapping, a flag's --draft-vocab-size): said
    out = tmp_path / "vm_8192"
    p, _ = run_script("03_build_vocab_mapping.py", "--prepared-data", str(prepared), "--draft-vocab-size",
                      "2000", "--output-dir", str(out))
    assert p.returncode == 0, p.stderr
    assert f"--output-dir {out}: its name says 8,192 tokens; this map has 2,000" in p.stderr, p.stderr
    d2t, t2d = np.load(out / "d2t.npy"), np.load(out / "t2d.npy")
    freq = np.load(prepared / "token_freq.npy")
    assert d2t.shape == (2000,) and t2d.shape == (49152,) and t2d.sum() == 2000
    assert np.array_equal(np.arange(2000) + d2t, np.flatnonzero(t2d))
    man = json.load(open(out / "manifest.json"))
    assert man["counts"]["coverage"] == pytest.approx(freq[t2d].sum() / freq.sum())
    assert "coverage:" in p.stdout


def bad(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def assert_refused(p, secs, *needles):
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert loaded_nothing(p), f"refused only after importing {p.heavy}"


@pytest.mark.parametrize("name,content,needles", [
    ("d.jsonl", json.dumps(GOOD) + "\n{not json\n", ["d.jsonl:2", "malformed JSON"]),
    ("d.jsonl", json.dumps({"messages": "x"}) + "\n", ["d.jsonl:1", "must be a list"]),
    ("d.jsonl", json.dumps({"conversations": [{"from": "wizard", "value": "x"}]}) + "\n", ["unknown role 'wizard'"]),
    ("d.jsonl", "", ["file is empty"]),
    ("d.jsonl", b'{"messages": []}\n\x80\x81\n', ["d.jsonl:2", "not UTF-8"]),
    # every answer empty: it trained on the end-of-turn token alone, in silence
    ("d.jsonl", json.dumps({"messages": []}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "q"}]})
     + "\n" + json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}),
     ["no trainable conversation", "'empty': 1", "'no_assistant_turn': 1", "'empty_answers': 1"]),
    ("d.txt", "hello", ["unsupported file type"]),
])
def test_prepare_refuses_bad_data(tmp_path, model_path, name, content, needles):
    path = bad(tmp_path, name, content)
    p, secs = run_script("01_prepare_dataset.py", "--model-path", model_path, "--dataset", path,
                         "--output-dir", str(tmp_path / "out"))
    assert_refused(p, secs, *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,needles", [
    (["--data-path", "x"], ["unknown flag --data-path", "did you mean --prepared-data"]),
    (["--prepared-data", "/nonexistent"], ["--prepared-data /nonexistent", "01_prepare_dataset.py"]),
    (["--draft-vocab-size", "abc"], ["--draft-vocab-size", "invalid int"]),
    (["--prepared-data", "README.md"], ["--prepared-data README.md: is a file, expected its output folder"]),
])
def test_vocab_refuses_bad_flags(argv, needles):
    p, secs = run_script("03_build_vocab_mapping.py", *argv)
    assert_refused(p, secs, *needles)


def test_vocab_refuses_too_large_and_wrong_stage(prepared, tmp_path):
    p, secs = run_script("03_build_vocab_mapping.py", "--prepared-data", str(prepared),
                         "--draft-vocab-size", "50000", "--output-dir", str(tmp_path / "v"))
    assert_refused(p, secs, "--draft-vocab-size 50000", "49152")
    p, secs = run_script("03_build_vocab_mapping.py", "--prepared-data", str(prepared), "--output-dir", str(prepared))
    assert_refused(p, secs, "is the input --prepared-data")


def test_prepare_refuses_bad_flags_and_paths(tmp_path, model_path):
    cases = [
        (["--model-path", "/no/such/model"], ["--model-path /no/such/model"]),
        (["--model-path", model_path, "--max-seq-len", "0"], ["--max-seq-len 0"]),
        (["--model-path", model_path, "--max-seq-len", "100000000000"],
         ["--max-seq-len 100000000000: rows this long", "past the 8,192 positions the verifier handles"]),
        (["--model-path", model_path, "--num-smaples", "3"], ["did you mean --num-samples"]),
        (["--model-path", model_path, "--num-workers", "-1"], ["--num-workers -1"]),
        (["--model-path", model_path, "--num-workers", str(2 * len(os.sched_getaffinity(0)) + 1)],
         ["more than twice the", "CPU cores this process may use"]),
        (["--dataset", "sharegpt"], ["missing --model-path"]),
        (["--model-path", model_path, "--output-dir", str(tmp_path)], ["holds 'keep.txt'", "did not make"]),
    ]
    # --regenerate's flags, refused before vLLM starts (it refused them 7 s later) and before the folder is taken
    fresh = ["--model-path", model_path, "--regenerate", "--output-dir", str(tmp_path / "new")]
    cases += [
        (fresh + ["--regen-tp-size", "4"], ["--regen-tp-size 4: must divide the verifier's num_attention_heads (9)"]),
        (fresh + ["--regen-tp-size", "3"], ["--regen-tp-size 3: no GPU visible; on CPU use --regen-tp-size 1"]),
        (fresh + ["--regen-batch-size", "99999999"], ["--regen-batch-size 99999999", "max_num_batched_tokens",
                                                      "at most 4096"]),
        (fresh + ["--regen-max-tokens", "600", "--max-seq-len", "512"],
         ["--regen-max-tokens 600: with --max-seq-len 512 an answer has at most 510 tokens"]),
    ]
    (tmp_path / "keep.txt").write_text("a person's file")
    for argv, needles in cases:
        p, secs = run_script("01_prepare_dataset.py", *argv)
        assert_refused(p, secs, *needles)
    assert (tmp_path / "keep.txt").exists() and not (tmp_path / "new").exists()


def test_config_errors(tmp_path, model_path):
    for text, needle in [("max_seq_len: abc\n", "key 'max_seq_len' must be an integer"),
                         ("max_seq_lenn: 5\n", "unknown key 'max_seq_lenn'; did you mean 'max_seq_len'?"),
                         ("seed: 1\nseed: 2\n", "key 'seed' given twice (line 2)"),
                         ("prepare:\n  batch_size: 4\n", "unknown key 'prepare.batch_size' (stage prepare does not take it)"),
                         ("train:\n  lrr: 1\n", "unknown key 'train.lrr'"),
                         ("[1, 2\n", "not valid YAML")]:
        cfg = bad(tmp_path, "c.yaml", text)
        p, secs = run_script("01_prepare_dataset.py", "--config", cfg, "--model-path", model_path)
        assert_refused(p, secs, needle)


def test_the_default_model_conversion_never_replaces_a_folder_it_did_not_make(tmp_path):
    """scripts/setup.sh converts the embedded verifier into a folder; a folder of the same name without its stamp is
    someone's, and is left as it is."""
    from conftest import assert_refused, snapshot
    mine = tmp_path / "smollm2"
    mine.mkdir()
    (mine / "notes.txt").write_text("a person's notes")
    before = snapshot(tmp_path)
    p, secs = run_script("-m", "eagle3pipe.prepare.default_model", "--output-dir", str(mine))
    assert_refused(p, secs, str(mine), "not a conversion of this script")
    assert snapshot(tmp_path) == before


def _edited_copy(prepared, dst, manifest=None, freq=None):
    import shutil
    shutil.copytree(prepared, dst)
    if manifest:
        man = json.load(open(dst / "manifest.json"))
        manifest(man)
        (dst / "manifest.json").write_text(json.dumps(man))
    if freq:
        f = np.load(dst / "token_freq.npy")
        np.save(dst / "token_freq.npy", freq(f))
    return dst


@pytest.mark.parametrize("edit,needles", [
    (dict(manifest=lambda m: m["verifier"].update(vocab_size=None)), ["manifest.json", "'vocab_size'", "NoneType"]),
    (dict(manifest=lambda m: m["verifier"].update(vocab_size="49152")), ["manifest.json", "'vocab_size'", "str"]),
    (dict(manifest=lambda m: m["verifier"].update(vocab_size=0)), ["manifest.json", "'vocab_size'", "is 0"]),
    (dict(manifest=lambda m: m["verifier"].update(vocab_size=True)), ["manifest.json", "'vocab_size'", "bool"]),
    # another run's counts (here: twice this run's), and counts no stage 01 writes
    (dict(freq=lambda f: f * 2), ["token_freq.npy", "not this run's file", "rerun 01_prepare_dataset.py"]),
    (dict(freq=lambda f: np.roll(f, 1)), ["token_freq.npy", "changed since stage 01 wrote it"]),  # the sum kept
    (dict(freq=lambda f: np.where(np.arange(f.size) == 7, -5000, f)), ["token_freq.npy", "negative counts",
                                                                          "token id 7"]),
])
def test_vocab_refuses_a_stage01_folder_whose_manifest_or_counts_do_not_hold(prepared, tmp_path, edit, needles):
    src = _edited_copy(prepared, tmp_path / "prep", **edit)
    p, secs = run_script("03_build_vocab_mapping.py", "--prepared-data", str(src), "--draft-vocab-size", "512",
                         "--output-dir", str(tmp_path / "v"))
    assert_refused(p, secs, *needles)
    assert not (tmp_path / "v").exists()


def test_refusals_that_need_the_template_leave_no_folder_and_blame_the_right_input(tmp_path, model_path):
    """A chat template that fails on every conversation (here one that raises as it renders) is the verifier's
    fault, named by --model-path; one that does not parse is named before the tokenizer loads; rows too short to
    train on are the data's. Each is found before the output folder is taken."""
    model = model_with_template(model_path, tmp_path / "model",
                                "{% for message in messages %}{{ message['content'] }}")  # no endfor
    data = bad(tmp_path, "d.jsonl", json.dumps(GOOD) + "\n")
    p, secs = run_script("01_prepare_dataset.py", "--model-path", str(model), "--dataset", data,
                         "--output-dir", str(tmp_path / "out"))
    assert_refused(p, secs, f"{model}/chat_template.jinja: the chat template does not parse (line 1: Unexpected end "
                            f"of template")
    assert not (tmp_path / "out").exists()
    (model / "chat_template.jinja").write_text("{{ raise_exception('no system prompt given') }}")
    p, secs = run_script("01_prepare_dataset.py", "--model-path", str(model), "--dataset", data,
                         "--output-dir", str(tmp_path / "out"))
    assert p.returncode == 2 and f"error: --model-path {model}: its chat template fails on every conversation" \
        in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out").exists()
    p, secs = run_script("01_prepare_dataset.py", "--model-path", model_path, "--dataset", data, "--max-seq-len", "8",
                         "--output-dir", str(tmp_path / "out"))
    assert p.returncode == 2 and "no trainable conversation" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_turns_the_template_does_not_place_are_said_and_a_selection_reads_nothing_past_it(tmp_path, model_path):
    """A template that drops earlier answers: the turns left untrained were only a count in the manifest, and when
    none was left the data was blamed. And --num-samples N read record N+1: a broken record outside the selection
    stopped the run."""
    model = model_with_template(
        model_path, tmp_path / "model",
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    two = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]}
    data = bad(tmp_path, "d.jsonl", json.dumps(two) + '\n{"messages": [\n')
    p, _ = run_script("01_prepare_dataset.py", "--model-path", str(model), "--dataset", data, "--num-samples", "1",
                      "--output-dir", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"WARNING --model-path {model}: its chat template renders 1 of 2 assistant turns where no render up to " \
           f"them puts them" in p.stderr and "left untrained" in p.stderr, p.stderr[-2000:]
    counts = json.load(open(tmp_path / "out" / "manifest.json"))["counts"]
    assert counts["unaligned_turns"] == 1 and counts["records_read"] == 1
    one = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                        {"role": "user", "content": "q2"}]}  # its only answer is an earlier turn: never placed
    p, secs = run_script("01_prepare_dataset.py", "--model-path", str(model), "--dataset",
                         bad(tmp_path, "e.jsonl", json.dumps(one) + "\n"), "--output-dir", str(tmp_path / "out2"))
    assert p.returncode == 2 and f"error: --model-path {model}: its chat template renders 1 of 1 assistant turns" \
        in p.stderr and "no conversation has a turn left to train" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out2").exists()


def test_tool_use_trains_the_call_inside_its_turn_and_a_template_that_drops_calls_is_refused(tmp_path, model_path,
                                                                                            tokenizer):
    """Tool-use records were refused whatever the verifier. With a template that renders tool use (Qwen2.5's), the
    call is trained as the rest of its answer (its arguments written as the object vLLM hands the template, not as
    quoted text), and the tool definitions and results are context. A template that drops calls (the embedded
    SmolLM2's) would teach the draft to end the turn where the verifier calls: when it renders no call of any record,
    the run is refused naming the first, before the folder is taken."""
    from conftest import FIXTURES
    model = model_with_template(model_path, tmp_path / "model",
                                open(os.path.join(FIXTURES, "templates", "qwen2.5-tools.jinja")).read())
    tool = {"id": "t1", "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
            "messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                         {"role": "tool", "content": "sunny"},
                         {"role": "assistant", "content": "It is sunny."}]}
    data = bad(tmp_path, "d.jsonl", json.dumps(GOOD) + "\n" + json.dumps(tool) + "\n")
    p, _ = run_script("01_prepare_dataset.py", "--model-path", str(model), "--dataset", data,
                      "--output-dir", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr[-2000:]
    row = next(r for r in map(json.loads, open(tmp_path / "out" / "tokenized_data.jsonl")) if r["id"] == "t1")
    trained, cur = [], []
    for i, m in zip(row["input_ids"] + [None], row["loss_mask"] + [0]):
        if m:
            cur.append(i)
        elif cur:
            trained.append(tokenizer.decode(cur)); cur = []
    assert trained == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
                       "It is sunny.<|im_end|>\n"]
    text = tokenizer.decode(row["input_ids"])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text  # the tools: context
    assert "<tool_response>\nsunny\n</tool_response>" in text  # the result: context
    p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--dataset", data, "--num-workers", "2",
                      "--output-dir", str(tmp_path / "out2"))  # the first record named as one process names it
    lines = [line for line in p.stderr.strip().splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and lines == [
        f"error: --model-path {model_path}: its chat template renders no tool call (1 of the records call tools; "
        f"first: record t1: message 1's call to 'get_weather' is not in its render); leave records with tool calls "
        f"out, or give a template that renders them (docs/STAGES.md, stage 01)"], p.stderr[-2000:]
    assert "Traceback" not in p.stderr and not (tmp_path / "out2").exists()
