"""Input rules with no model: dataset folders' hidden entries and links, ids of any JSON type made strings, a
verifier config nested too deep."""
import json
import os

import pytest

from eagle3pipe.chat import conversations as conv, messages
from eagle3pipe.verifier import verifier
from eagle3pipe.config.cli import UsageError

from conftest import CHAT, chat_folder


def test_folder_hidden_entries_skipped_links_to_files_followed(tmp_path):
    d = chat_folder(tmp_path)
    (d / ".git" / "objects").mkdir(parents=True)
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (d / ".DS_Store").write_bytes(b"\0\1")
    (tmp_path / "elsewhere.jsonl").write_text(json.dumps(CHAT) + "\n" + json.dumps(CHAT) + "\n")
    os.symlink(tmp_path / "elsewhere.jsonl", d / "sub" / "c.jsonl")
    conv.check_dataset(str(d))
    assert conv.dataset_files(str(d)) == [f"{d}/a.jsonl", f"{d}/sub/b.json", f"{d}/sub/c.jsonl"]
    assert len(list(conv.iter_records(str(d)))) == 4


def test_ids_become_strings_safely():
    nested = {"b": [1, {"c": None}], "a": "\ud800"}
    assert messages.normalize("r", {**CHAT, "id": nested})[0] == '{"a":"\\ud800","b":[1,{"c":null}]}'
    assert messages.normalize("r", {**CHAT, "id": 7})[0] == "7"
    assert messages.normalize("r", {**CHAT, "conversation_id": [1, 2]})[0] == "[1,2]"
    deep = json.loads("[" * 500 + "]" * 500)
    assert json.loads(messages.normalize("r", {**CHAT, "id": deep})[0]) == deep
    with pytest.raises(UsageError, match=r"^r: 'id' is not valid Unicode"):
        messages.normalize("r", {**CHAT, "id": "x\udfff"})


DEEP = 100_000


def test_verifier_config_nested_too_deep(tmp_path):
    (tmp_path / "config.json").write_text("[" * DEEP)
    with pytest.raises(UsageError, match="config.json: not valid JSON \\(nested too deep\\)"):
        verifier.fingerprint(str(tmp_path))


@pytest.mark.parametrize("edit,needle", [
    ({"max_position_embeddings": "8192"}, "'max_position_embeddings' is '8192'"),
    ({"num_hidden_layers": 30.0}, "'num_hidden_layers' is 30.0"),
    ({"num_attention_heads": 0}, "'num_attention_heads' is 0"),
    ({"hidden_size": True}, "'hidden_size' is True"),
    ({"architectures": "LlamaForCausalLM"}, "'architectures' is 'LlamaForCausalLM', expected a list"),
])
def test_a_verifier_config_with_a_count_of_the_wrong_type_is_named(tmp_path, edit, needle):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
           "vocab_size": 49152, "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert verifier.fingerprint(str(tmp_path))["num_hidden_layers"] == 30
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(UsageError, match=f"--model-path {tmp_path}: config.json's {needle}"):
        verifier.fingerprint(str(tmp_path))


def test_a_verifier_folder_without_whole_weights_is_named(tmp_path):
    """No weights, a GGUF file alone, a safetensors file cut short: one line before any model loads (the loaders
    find each only as they load)."""
    import struct
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="no weight files"):
        verifier.check_weights(str(tmp_path))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(UsageError, match=r"holds only a GGUF file \(model.gguf\)"):
        verifier.check_weights(str(tmp_path))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    whole = struct.pack("<Q", len(header)) + header + bytes(16)
    (tmp_path / "model.safetensors").write_bytes(whole)
    verifier.check_weights(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(whole[:-4])
    with pytest.raises(UsageError, match="model.safetensors: its tensors end at data byte 16, the file holds 12 "
                                         "data bytes: cut short"):
        verifier.check_weights(str(tmp_path))


def test_a_verifier_folder_without_tokenizer_files_or_chat_template_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="no tokenizer files"):
        verifier.check_chat_files(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8192}))
    with pytest.raises(UsageError, match="no chat template"):
        verifier.check_chat_files(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    verifier.check_chat_files(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    verifier.check_chat_files(str(tmp_path))


@pytest.mark.parametrize("where,text,says", [
    ("chat_template.jinja", "{% for m in messages %}{{ m.content }", r"chat_template.jinja: the chat template does not "
                                                                     r"parse \(line 1: unexpected '}'\)"),
    ("chat_template.jinja", "{% generation %}{{ m }}", "chat_template.jinja: the chat template does not parse"),
    ("tokenizer_config.json", {"chat_template": "{% if x %}"}, "tokenizer_config.json: the chat template does not"),
    ("tokenizer_config.json", {"chat_template": [{"name": "default", "template": "{{ x }}"},
                                                 {"name": "tool_use", "template": "{{ x"}]},
     r"tokenizer_config.json \('tool_use'\): the chat template does not parse"),
])
def test_a_chat_template_that_does_not_parse_is_named_before_transformers_loads(tmp_path, where, text, says):
    # it failed at the first conversation, exit 1, as "TemplateSyntaxError (raised in jinja2): unexpected '}'"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / where).write_text(text if isinstance(text, str) else json.dumps(text))
    with pytest.raises(UsageError, match=says):
        verifier.check_chat_files(str(tmp_path))


def test_the_templates_transformers_takes_parse(tmp_path):
    # its {% generation %} block (assistant masks) and loop controls are part of the language it renders
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}{% if loop.index > 99 %}{% break %}{% endif %}{% endfor %}")
    verifier.check_chat_files(str(tmp_path))


def test_a_generation_config_that_does_not_parse_is_named(tmp_path):
    # it names the tokens answers end at, and was ignored in silence when it did not parse (a held-out probe)
    verifier.check_generation_config(str(tmp_path))  # none: nothing to check
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(UsageError, match=r"generation_config.json: not valid JSON"):
        verifier.check_generation_config(str(tmp_path))
    (tmp_path / "generation_config.json").write_text("[2]")
    with pytest.raises(UsageError, match=r"generation_config.json: expected a JSON object, got list"):
        verifier.check_generation_config(str(tmp_path))


def test_a_long_template_is_parsed_whole_and_an_absurd_one_refused(tmp_path):
    # a valid template after a 9 MB comment was refused as unparsable: the check read its first 8 MiB (a held-out probe)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("{# " + "x" * (9 << 20) + " #}{{ messages }}")
    verifier.check_chat_files(str(tmp_path))
    with open(tmp_path / "chat_template.jinja", "r+b") as f:
        f.truncate(65 << 20)
    with pytest.raises(UsageError, match=r"chat_template.jinja: 65 MiB, past the 64 MiB a chat template may have"):
        verifier.check_chat_files(str(tmp_path))


def test_a_tokenizer_file_that_is_not_json_is_named_not_taken_for_another_verifier(tmp_path):
    # its hash differed from stage 01's: "come from different verifiers ... rerun 01_prepare_dataset.py"
    json.dump({"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 16}, open(tmp_path / "config.json", "w"))
    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0,')
    with pytest.raises(UsageError, match=r"tokenizer.json: not valid JSON .*the tokenizer cannot load"):
        verifier.fingerprint(str(tmp_path))
