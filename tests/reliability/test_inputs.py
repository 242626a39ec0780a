"""Bad inputs through the real scripts: dataset folders holding other things, text that is not valid Unicode,
JSON nested too deep, hub ids with no network, verifiers that ship their own code, broken draft configs. Each
must end in one `error:` line, exit code 2, in under 3 s, with every input file left as it was."""
import json
import os
import shutil

import pytest

from conftest import CHAT, assert_refused, chat_folder, run_script, snapshot
from eagle3pipe.verifier import verifier
from eagle3pipe.config.cli import UsageError
from eagle3pipe.evaluate.evaluation import check_draft


DEEP = 100_000


def env(tmp_path, **extra):
    # an empty HF home: nothing cached, remote code never lands in ~/.cache
    return {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", **extra}


def prepare(model_path, tmp_path, *args, **extra_env):
    """Stage 01 on `args`; the inputs under tmp_path must be untouched afterwards."""
    inputs = [c for c in tmp_path.iterdir() if c.name not in ("out", "hf")]
    before = snapshot(*inputs)
    p, secs = run_script("01_prepare_dataset.py", "--model-path", model_path, "--output-dir", str(tmp_path / "out"),
                         *args, env=env(tmp_path, **extra_env), timeout=60)
    assert snapshot(*inputs) == before
    return p, secs


@pytest.mark.parametrize("make,entry,says", [
    (lambda d: (d / "notes.txt").write_text("hi"), "notes.txt", "is not a .jsonl, .json or .parquet file"),
    (lambda d: (d / "sub" / "x.csv").write_text("a,b"), "sub/x.csv", "is not a .jsonl, .json or .parquet file"),
    (lambda d: (d / "more.json").mkdir(), "more.json", "is a folder, not a regular file"),
    (lambda d: os.symlink(d / "gone.jsonl", d / "c.jsonl"), "c.jsonl", "a link to nothing"),
    (lambda d: os.mkfifo(d / "pipe.jsonl"), "pipe.jsonl", "is a FIFO, not a regular file"),
    (lambda d: os.mkfifo(d / "pipe"), "pipe", "is not a .jsonl, .json or .parquet file"),
    (lambda d: os.symlink(d, d / "sub" / "loop"), "sub/loop", "links to a folder already in the dataset"),
])
def test_folder_holding_anything_else_is_refused_naming_it(model_path, tmp_path, make, entry, says):
    d = chat_folder(tmp_path)
    make(d)
    p, secs = prepare(model_path, tmp_path, "--dataset", str(d))
    assert_refused(p, secs, f"--dataset {d}: {d}/{entry} ", says)


def test_special_file_given_directly_is_refused(model_path, tmp_path):
    os.mkfifo(tmp_path / "pipe.jsonl")
    p, secs = prepare(model_path, tmp_path, "--dataset", str(tmp_path / "pipe.jsonl"))
    assert_refused(p, secs, "pipe.jsonl: not a regular file or folder")


@pytest.mark.parametrize("message,says", [
    ('{"role": "user", "content": "ok \\ud800"}', "message 1 content is not valid Unicode"),
    ('{"role": "us\\udfffer", "content": "q"}', "message 1 role is not valid Unicode"),
    ('{"role": "user", "content": [{"type": "text", "text": "\\udc80"}]}', "message 1 content is not valid Unicode"),
])
def test_lone_surrogate_is_refused_naming_line_and_message(model_path, tmp_path, message, says):
    f = tmp_path / "d.jsonl"
    bad = '{"messages": [{"role": "system", "content": "s"}, ' + message + "]}"
    f.write_text(json.dumps(CHAT) + "\n" + bad + "\n")
    p, secs = prepare(model_path, tmp_path, "--dataset", str(f))
    assert_refused(p, secs, f"{f}:2: {says}")


def test_lone_surrogate_in_json_array_names_the_record(model_path, tmp_path):
    f = tmp_path / "d.json"
    f.write_text('[%s, {"conversations": [{"from": "human", "value": "\\ud83d"}]}]' % json.dumps(CHAT))
    p, secs = prepare(model_path, tmp_path, "--dataset", str(f))
    assert_refused(p, secs, f"{f}: record 1: message 0 content is not valid Unicode")


@pytest.mark.parametrize("name,text,where", [
    ("d.jsonl", json.dumps(CHAT) + "\n" + "[" * DEEP + "\n", "d.jsonl:2: JSON nested too deep"),
    ("d.jsonl", '{"messages": [{"role": "user", "content": ' + "[" * DEEP + "]" * DEEP + "}]}\n",
     "d.jsonl:1: JSON nested too deep"),
    ("d.json", "[" * DEEP + "]" * DEEP, "d.json: JSON nested too deep"),
    ("d.json", "[%s, {\"messages\": [{\"role\": \"user\", \"content\": %s}]}]" % (
        json.dumps(CHAT), "[" * DEEP + "]" * DEEP), "d.json: JSON nested too deep"),
])
def test_nested_too_deep_is_one_line(model_path, tmp_path, name, text, where):
    (tmp_path / name).write_text(text)
    p, secs = prepare(model_path, tmp_path, "--dataset", str(tmp_path / name))
    assert_refused(p, secs, where)


def test_model_hub_id_unreachable_fails_fast(tmp_path):
    p, secs = run_script("01_prepare_dataset.py", "--model-path", "nosuch-org/nosuch-model", "--output-dir",
                         str(tmp_path / "out"), env=env(tmp_path), timeout=60)
    assert_refused(p, secs, "--model-path nosuch-org/nosuch-model: not a local folder, not in the local HF cache, "
                   "and the hub (huggingface.co) cannot be reached; give a local model folder")


def test_model_hub_id_offline_fails_fast(tmp_path):
    p, secs = run_script("01_prepare_dataset.py", "--model-path", "nosuch-org/nosuch-model", "--output-dir",
                         str(tmp_path / "out"), env=env(tmp_path, HF_HUB_OFFLINE="1"), timeout=60)
    assert_refused(p, secs, "not in the local HF cache, and HF_HUB_OFFLINE is set")


def test_dataset_hub_id_unreachable_fails_fast(model_path, tmp_path):
    p, secs = prepare(model_path, tmp_path, "--dataset", "nosuch-org/nosuch-data")
    assert_refused(p, secs, "--dataset nosuch-org/nosuch-data: not a local file or folder, not in the local HF "
                   "cache, and the hub (huggingface.co) cannot be reached")


def test_model_in_the_local_hf_cache_is_used_without_the_hub(model_path, tmp_path):
    """A hub id already in the HF cache needs no network: stage 01 gets past the verifier to the dataset check."""
    repo = tmp_path / "hf" / "hub" / "models--someorg--smol"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(model_path, name), snap / name)
    p, secs = prepare("someorg/smol", tmp_path, "--dataset", str(tmp_path / "missing.jsonl"))
    assert_refused(p, secs, f"--dataset {tmp_path / 'missing.jsonl'}: no such file or folder")


def test_prompts_hub_id_unreachable_fails_fast(model_path, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3",
                                                   "transformer_layer_config": {"hidden_size": 576}}))
    before = snapshot(draft)
    p, secs = run_script("05_evaluate.py", "--model-path", model_path, "--draft", str(draft), "--prompts",
                         "nosuch-org/nosuch-prompts", "--output-dir", str(tmp_path / "out"), env=env(tmp_path),
                         timeout=60)
    assert_refused(p, secs, "--prompts nosuch-org/nosuch-prompts: not a local file or folder")
    assert snapshot(draft) == before


def _model_copy(model_path, tmp_path, marker, config=None, tokenizer_config=None):
    """The real SmolLM2's config and tokenizer files (no weights), with `auto_map` entries pointing at a .py file
    whose import writes `marker`."""
    m = tmp_path / "model"
    m.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(model_path, name), m / name)
    code = f"open({str(marker)!r}, 'w').write('ran')\n"
    for name, extra in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if extra:
            cfg = json.loads((m / name).read_text())
            (m / name).write_text(json.dumps({**cfg, **extra}))
    (m / "my_tok.py").write_text(code + "from transformers import TokenizersBackend\n"
                                 "class MyTokenizer(TokenizersBackend):\n    pass\n")
    (m / "my_arch.py").write_text(code + "from transformers import PretrainedConfig\n"
                                  "class MyConfig(PretrainedConfig):\n    model_type = 'my_arch'\n")
    return m


REMOTE_TOKENIZER = {"auto_map": {"AutoTokenizer": ["my_tok.MyTokenizer", None]}, "tokenizer_class": "MyTokenizer"}


REMOTE_MODEL = {"model_type": "my_arch", "auto_map": {"AutoConfig": "my_arch.MyConfig",
                                                      "AutoModel": "my_arch.MyModel"}}


@pytest.mark.parametrize("config,tokenizer_config,says", [
    (None, REMOTE_TOKENIZER, "the tokenizer ships its own code"),
    (REMOTE_MODEL, None, "the model ships its own code"),
])
def test_remote_code_needs_the_flag_and_never_runs(model_path, tmp_path, config, tokenizer_config, says):
    marker = tmp_path / "ran_remote_code"
    m = _model_copy(model_path, tmp_path, marker, config, tokenizer_config)
    (tmp_path / "d.jsonl").write_text(json.dumps(CHAT) + "\n")
    p, secs = prepare(str(m), tmp_path, "--dataset", str(tmp_path / "d.jsonl"))
    assert_refused(p, secs, f"--model-path {m}: {says}", "--trust-remote-code")
    assert not marker.exists()


def test_known_model_types_and_tokenizers_pass(model_path, tmp_path):
    verifier.check_remote_code(model_path, False)
    # auto_map beside a type and a class transformers knows: transformers uses its own code, nothing to refuse
    m = _model_copy(model_path, tmp_path, tmp_path / "marker", config={"auto_map": {"AutoModel": "x.Y"}},
                    tokenizer_config={"auto_map": {"AutoTokenizer": ["x.Y", None]}, "tokenizer_class": "GPT2Tokenizer"})
    verifier.check_remote_code(str(m), False)
    (tmp_path / "b").mkdir()
    m2 = _model_copy(model_path, tmp_path / "b", tmp_path / "marker", REMOTE_MODEL, REMOTE_TOKENIZER)
    verifier.check_remote_code(str(m2), True)  # the operator opted in


def test_load_tokenizer_turns_transformers_refusal_into_one_line(model_path, tmp_path):
    """The backstop behind check_remote_code: transformers' own refusal, as one UsageError naming the flag."""
    from eagle3pipe.chat.masks import load_tokenizer
    marker = tmp_path / "ran_remote_code"
    m = _model_copy(model_path, tmp_path, marker, REMOTE_MODEL, REMOTE_TOKENIZER)
    with pytest.raises(UsageError, match="ships its own code.*--trust-remote-code") as e:
        load_tokenizer(str(m), trust_remote_code=False)
    assert "\n" not in str(e.value)
    assert not marker.exists()


@pytest.mark.parametrize("text,says", [
    ('{"speculators_model_type": "eag', "config.json: not valid JSON"),
    ("\xff\xfe", "config.json: not valid JSON"),
    ("[1, 2]", "config.json holds a JSON list, not a checkpoint config"),
    ("{}", "not an eagle3 speculators checkpoint"),
    ('{"speculators_model_type": "eagle3"}', "config.json lacks transformer_layer_config.hidden_size"),
    ('{"speculators_model_type": "eagle3", "transformer_layer_config": [576]}',
     "config.json lacks transformer_layer_config.hidden_size"),
    ("[" * DEEP, "config.json: not valid JSON (nested too deep)"),
])
def test_broken_draft_config_is_one_line(model_path, tmp_path, text, says):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_bytes(text.encode("latin-1"))
    fp = verifier.fingerprint(model_path)
    with pytest.raises(UsageError, match="rerun 04_train.py") as e:
        check_draft(str(draft), fp)
    assert says in str(e.value) and str(e.value).startswith(f"--draft {draft}: ") and "\n" not in str(e.value)
    before = snapshot(draft)
    p, secs = run_script("05_evaluate.py", "--model-path", model_path, "--draft", str(draft), "--output-dir",
                         str(tmp_path / "out"), env=env(tmp_path), timeout=60)
    assert_refused(p, secs, f"--draft {draft}: ", says, "rerun 04_train.py")
    assert snapshot(draft) == before


def test_broken_train_manifest_beside_the_draft(model_path, tmp_path):
    draft = tmp_path / "ckpt" / "last"
    draft.mkdir(parents=True)
    (draft / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3",
                                                   "transformer_layer_config": {"hidden_size": 576}}))
    (tmp_path / "ckpt" / "manifest.json").write_text('{"stage": "tr')
    with pytest.raises(UsageError, match=r"manifest.json: not valid JSON .*rerun 04_train.py"):
        check_draft(str(draft), verifier.fingerprint(model_path))
    (tmp_path / "ckpt" / "manifest.json").write_text('[]')
    assert check_draft(str(draft), verifier.fingerprint(model_path))["speculators_model_type"] == "eagle3"
