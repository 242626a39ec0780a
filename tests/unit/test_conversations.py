"""Record parsing: both formats, role aliases, tool use, the embedded ShareGPT stream, and errors naming the record."""
import argparse
import json

import pytest

from eagle3pipe.chat import conversations as conv, messages as chat
from eagle3pipe.config.cli import UsageError



def test_sharegpt_and_openai_formats():
    rid, msgs = chat.normalize("r", {"id": "a", "conversations": [
        {"from": "system", "value": "s"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
        {"from": "user", "value": "q2"}, {"from": "chatgpt", "value": "a2"}, {"from": "bing", "value": "a3"},
        {"from": "bard", "value": "a4"}]})
    assert rid == "a"
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "assistant", "assistant"]
    rid, msgs = chat.normalize("r", {"messages": [{"role": "user", "content": "q"},
                                                  {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                                                    {"type": "text", "text": "b"}]}]})
    assert rid is None and msgs == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}]


def test_each_format_takes_the_other_s_keys_and_openai_s_developer_role():
    # 'messages' written with from/value was refused as "content must be a string, got NoneType"
    _, msgs = chat.normalize("r", {"messages": [{"role": "developer", "content": "be brief"},
                                                {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]})
    assert msgs == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"}]
    _, msgs = chat.normalize("r", {"conversations": [{"role": "user", "content": "q"}, {"from": "gpt", "value": "a"}]})
    assert msgs == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_a_null_field_is_an_absent_one_and_reasoning_is_kept():
    # Arrow fills the other format's column with null: the record was skipped as empty
    _, msgs = chat.normalize("r", {"conversations": None, "messages": [{"role": "user", "content": "q"},
                                                                      {"role": "assistant", "content": "a"}]})
    assert msgs == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    _, msgs = chat.normalize("r", {"conversations": [{"from": "human", "value": "q"}], "messages": None})
    assert msgs == [{"role": "user", "content": "q"}]
    assert chat.normalize("r", {"conversations": None, "messages": None})[1] == []
    # a parquet of both formats: every message has all four keys, the other format's null
    both = {"from": None, "value": None, "role": "user", "content": "q"}, {"from": "gpt", "value": "a", "role": None,
                                                                          "content": None}
    assert chat.normalize("r", {"conversations": list(both)})[1] == [{"role": "user", "content": "q"},
                                                                    {"role": "assistant", "content": "a"}]
    assert chat.normalize("r", {"messages": list(both)})[1] == [{"role": "user", "content": "q"},
                                                               {"role": "assistant", "content": "a"}]
    # a reasoning template renders it: dropping it trained an empty thinking block
    _, msgs = chat.normalize("r", {"messages": [{"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "A", "reasoning_content": "think"}]})
    assert msgs[1] == {"role": "assistant", "content": "A", "reasoning_content": "think"}


@pytest.mark.parametrize("record,match", [
    ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown role 'alien'"),
    # a tool call must say what it calls, with an object of arguments (JSON text or the object itself)
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                      "tool_calls": [{"id": "1", "type": "function"}]}]},
     r"message 1 tool call 0 must be \{\"type\": \"function\""),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                                      "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     r"message 1 tool call 0 has no function name"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"function": {"name": "f", "arguments": '{"city": "Par'}}]}]},
     r"message 1 tool call 0 \('f'\) arguments are not valid JSON \(Unterminated string"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1, 2]"}}]}]},
     r"message 1 tool call 0 \('f'\) arguments must be a JSON object, got list"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": "f()"}]},
     r"message 1 'tool_calls' must be a list"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "function_call": "auto"}]},
     r"message 1 'function_call' must be a call \(\{\"name\", \"arguments\"\}\), got str"),
    # a name is quoted in the line: a newline in it does not break the line in two
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get\nweather", "arguments": "{bad"}}]}]}, r"\('get\\nweather'\) arguments are not"),
    ({"conversations": "hello"}, "must be a list"),
    ({"conversations": [{"from": "human", "value": 3}]}, "content must be a string"),
    ({"text": "hi"}, "no 'conversations'"),
    (["not", "an", "object"], "expected a JSON object"),
])
def test_malformed_records_name_the_record(record, match):
    with pytest.raises(UsageError, match=match) as e:
        chat.normalize("data.jsonl:7", record)
    assert str(e.value).startswith("data.jsonl:7")


def test_tool_use_is_kept_as_chat_templates_read_it():
    """A call's arguments given as JSON text become their object, as vLLM hands them to the template when it serves
    (a template writes them with tojson: text would come out quoted); a call alone has "" as its text; a result keeps
    what pairs it with its call; OpenAI's older function_call and "function" results read as the newer form."""
    rec = {"tools": '[{"type": "function", "function": {"name": "get_weather"}}]', "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "tool_calls": []},
        {"role": "assistant", "content": None, "function_call": {"name": "get_time", "arguments": ""}},
        {"role": "function", "name": "get_time", "content": "noon"}]}
    _, msgs = chat.normalize("r", rec)
    assert msgs == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "c1"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
        {"role": "assistant", "content": "Sunny."},  # an empty list is no call
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "noon", "name": "get_time"}]
    assert chat.record_tools("r", rec) == [{"type": "function", "function": {"name": "get_weather"}}]
    assert chat.uses_tools(msgs, None) and chat.uses_tools([], [{"x": 1}]) and not chat.uses_tools(msgs[:1], [])
    assert chat.record_tools("r", {"messages": [], "tools": None}) is None  # Arrow's null column
    assert chat.record_tools("r", {"messages": [], "tools": [None]}) is None  # and its null entry
    for tools, match in (('[{"name": ', r"'tools' are not valid JSON"), ({"name": "f"}, r"'tools' must be a list"),
                         (["f"], r"'tools' entry 0 must be a JSON object, got str")):
        with pytest.raises(UsageError, match=match):
            chat.record_tools("r", {"messages": [], "tools": tools})
    # stage 05's prompt reads through the first user turn: a call in an earlier assistant turn is not its business
    _, head = chat.normalize("r", {"messages": [{"role": "assistant", "content": None, "tool_calls": "broken"},
                                                {"role": "user", "content": "q"}]}, through_first_user=True)
    assert head == [{"role": "assistant", "content": ""}, {"role": "user", "content": "q"}]


def test_jsonl_errors_name_the_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"messages": []}) + "\n{broken\n")
    with pytest.raises(UsageError, match=r"d.jsonl:2: malformed JSON"):
        list(conv.iter_records(str(p)))
    p.write_text(json.dumps({"messages": []}) + '\n{"id": "cut", "messages": [\n')
    with pytest.raises(UsageError, match=r"d.jsonl:2: malformed JSON \(Expecting value at column 28\)"):
        list(conv.iter_records(str(p)))  # where the line stops, not column 1 of its newline
    p.write_bytes(b'{"messages": []}\n\xff\xfe\n')
    with pytest.raises(UsageError, match=r"d.jsonl:2: not UTF-8"):
        list(conv.iter_records(str(p)))
    # valid JSON Python will not read: an integer of over 4,300 digits, in a field no stage uses
    big = '{"x": ' + "9" * 5000 + ', "messages": []}'
    p.write_text(json.dumps({"messages": []}) + "\n" + big + "\n")
    with pytest.raises(UsageError, match=r"d.jsonl:2: unreadable JSON \(Exceeds the limit \(4300 digits\)"):
        list(conv.iter_records(str(p)))
    (tmp_path / "d.json").write_text(f"[{big}]")
    with pytest.raises(UsageError, match=r"d.json: unreadable JSON \(Exceeds the limit"):
        list(conv.iter_records(str(tmp_path / "d.json")))
    p.write_bytes(b"")
    with pytest.raises(UsageError, match="file is empty"):
        list(conv.iter_records(str(p)))


def test_json_array_bom_and_folder(tmp_path):
    rec = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    (tmp_path / "a.json").write_text("\ufeff" + json.dumps([rec, rec]), encoding="utf-8")
    (tmp_path / "b.jsonl").write_text(json.dumps(rec) + "\n", encoding="utf-8")
    assert len(list(conv.iter_records(str(tmp_path / "a.json")))) == 2
    assert len(list(conv.iter_records(str(tmp_path)))) == 3


def test_embedded_sharegpt_streams_to_its_truncation():
    info = {}
    n = 0
    for where, rec in conv.iter_records("sharegpt", info=info):
        chat.normalize(where, rec)
        n += 1
    assert n == 17671 and info["truncated_source"] is True


def test_a_json_file_is_read_as_what_it_holds_not_as_its_first_bytes_look(tmp_path):
    rec = {"messages": [{"role": "user", "content": "q " * 1500}, {"role": "assistant", "content": "a"}]}
    cases = {
        "wrapper_indent0.json": json.dumps({"data": [rec, rec]}, indent=0),  # its first line is a lone "{"
        "lines_long.json": "\n" + "".join(json.dumps(rec) + "\n" for _ in range(2)),  # lines over 4 KiB
        "one_conversation.json": json.dumps(rec),
        "one_conversation_pretty.json": json.dumps(rec, indent=2),
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        got = list(conv.iter_records(str(tmp_path / name)))
        want = 1 if name.startswith("one_") else 2
        assert [r for _, r in got] == [rec] * want, name


def test_parquet_is_read_in_batches_with_both_formats_and_a_broken_file_is_named(tmp_path):
    """A parquet of both chat formats (Arrow gives every message all four keys, the other format's null) reads
    as each record's own format; records come batch by batch, so taking the first few reads no more; a file that
    is not parquet is one line naming it."""
    import itertools
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]} if i % 2 else
            {"conversations": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(600)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100)
    got = [chat.normalize(w, r)[1] for w, r in itertools.islice(conv.iter_records(str(path)), 3)]
    assert got == [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(3)]
    assert sum(1 for _ in conv.iter_records(str(path))) == 600
    bad = tmp_path / "cut.parquet"
    bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UsageError, match=r"cut.parquet: cannot read parquet"):
        list(conv.iter_records(str(bad)))


def test_the_name_sharegpt_is_the_embedded_data_and_a_local_folder_of_that_name_is_said_not_read(tmp_path,
                                                                                                 monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    conv.check_dataset("sharegpt")
    assert "not read" not in caplog.text
    (tmp_path / "sharegpt").mkdir()
    conv.check_dataset("sharegpt")
    assert "--dataset sharegpt: the embedded ShareGPT; ./sharegpt here is not read (give --dataset ./sharegpt" \
        in caplog.text


def test_regenerate_refuses_tool_use_naming_the_record_and_a_call_alone_is_an_answer(tmp_path):
    """--regenerate rewrites each answer from the verifier: a rewritten call would not be the call the next messages
    answer, so a record that calls or offers tools is refused before any model loads. Without it, a turn that only
    calls a tool is an answer (it was skipped as an empty one)."""
    import logging
    from eagle3pipe.prepare import preparation
    call = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}
    offer = {"tools": [{"type": "function", "function": {"name": "f"}}], "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    for rec, what in ((call, "calls a tool"), (offer, "offers tools")):
        data = tmp_path / "d.jsonl"
        data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant",
                                                                                 "content": "a"}]}) + "\n"
                        + json.dumps(rec) + "\n")
        args = argparse.Namespace(dataset=str(data), split="train", num_samples=None, regenerate=True)
        with pytest.raises(UsageError, match=rf"d.jsonl:2: --regenerate rewrites chat, not tool use: this record "
                                             rf"{what}; leave such records out, or drop --regenerate"):
            preparation.read_conversations(args, logging.getLogger("t"))
        args.regenerate = False
        records, n, skipped, _ = preparation.read_conversations(args, logging.getLogger("t"))
        assert n == 2 and len(records) == 2 and not skipped
        assert records[1][2] == (offer["tools"] if rec is offer else None)


def test_arrow_merged_keys_are_not_written_into_calls(tmp_path):
    """A parquet file gives each call's arguments (and each tool definition) every key any record's has, the others
    null: a call to search({"query": "x"}) beside one to get_weather({"city": "Paris"}) came out as
    {"city": null, "query": "x"}, a call the verifier never wrote. A null key is an absent one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def rec(name, args):
        return {"tools": [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}],
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": name, "arguments": args}}]}]}
    pq.write_table(pa.Table.from_pylist([rec("get_weather", {"city": "Paris"}), rec("search", {"query": "x"})]),
                   tmp_path / "d.parquet")
    got = [(chat.normalize(w, r)[1][1]["tool_calls"][0]["function"]["arguments"], chat.record_tools(w, r))
           for w, r in conv.iter_records(str(tmp_path / "d.parquet"))]
    assert [g[0] for g in got] == [{"city": "Paris"}, {"query": "x"}]
    assert got[1][1] == [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    # arguments given as JSON text are the model's own: their nulls stay
    _, msgs = chat.normalize("r", rec("f", '{"limit": null}'))
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"limit": None}


def test_a_json_records_nulls_are_its_own_and_nan_is_refused_naming_the_record(tmp_path):
    """A JSON record's explicit null in a call's arguments or a tool's schema is the record's (only Arrow's merged
    columns make nulls of absent keys), so it is kept as written. NaN and the infinities, which Python's json reads
    but JSON has not, are refused in one line naming the record, as an object or as text."""
    import pytest
    from eagle3pipe.base.errors import UsageError
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"limit": None, "q": {"x": None}}}}
    rec = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"default": None}}}],
           "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [call]}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(rec) + "\n")
    [(where, got)] = list(conv.iter_records(str(tmp_path / "d.jsonl")))
    assert chat.normalize(where, got)[1][1]["tool_calls"][0]["function"]["arguments"] == {"limit": None,
                                                                                          "q": {"x": None}}
    assert chat.record_tools(where, got)[0]["function"]["parameters"] == {"default": None}
    for args in ('{"limit": NaN}', '{"x": -Infinity}', {"limit": float("nan")}, {"x": [float("inf")]}):
        call["function"]["arguments"] = args
        (tmp_path / "d.jsonl").write_text(json.dumps(rec) + "\n")
        [(where, got)] = list(conv.iter_records(str(tmp_path / "d.jsonl")))
        with pytest.raises(UsageError) as e:
            chat.normalize(where, got)
        assert str(e.value).startswith(f"{tmp_path / 'd.jsonl'}:1: message 1 tool call 0 ('f') arguments "), e.value
