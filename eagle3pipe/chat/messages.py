"""One chat record -> the messages its verifier's chat template renders, validated, without torch.

Formats, detected per record: ShareGPT `conversations[{from, value}]` and OpenAI-style `messages[{role, content}]`
(a message written with the other format's keys is read too). OpenAI tool use is kept as chat templates read it:
an assistant message's `tool_calls` (or the older `function_call`), a `tool` (or `function`) message's
`tool_call_id` and `name`, and the record's `tools` (record_tools). A malformed record (wrong types, an unknown
role, a malformed call, text that is not valid Unicode) is a UsageError naming where it was read.
"""
import json

from ..base.errors import UsageError
from .conversations import ArrowRecord, first_words

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system", "developer": "system",  # OpenAI's newer name for the system message
    "tool": "tool", "function": "tool",  # "function": the result of OpenAI's older function_call
}


def _text(value, where, what):
    """`value` if it is valid Unicode: json.loads accepts a lone surrogate ("\\ud800") that no UTF-8 writer or
    tokenizer can take, and it would fail far from its record."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{where}: {what} is not valid Unicode ({value[e.start]!r} at character {e.start})")
    return value


def _content(value, where, j):
    if isinstance(value, str):
        return _text(value, where, f"message {j} content")
    if isinstance(value, list):  # OpenAI content parts: keep the text ones
        parts = []
        for p in value:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise UsageError(f"{where}: message {j} has a non-text content part; only text is supported")
            parts.append(p["text"])
        return _text("".join(parts), where, f"message {j} content")
    raise UsageError(f"{where}: message {j} content must be a string, got {type(value).__name__}")


def _parsed(text, where, what):
    """JSON text -> its value ('' and blanks -> None), or one line naming what failed to parse."""
    if not text.strip():
        return None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise UsageError(f"{where}: {what} are nested too deep")
    except ValueError as e:
        raise UsageError(f"{where}: {what} are not valid JSON ({first_words(e)})")


def _no_constant(name):
    """NaN, Infinity, -Infinity: Python's json reads them, JSON has no such numbers, and a template would write them
    into a call no tool parses."""
    raise ValueError(f"{name} is not a JSON number")


def _json_object(value, where, what, text=True, arrow=False):
    """A JSON object given as one (a dict) or, with `text`, as its JSON text (OpenAI's wire format) -> dict; '' and
    null -> {}. Nulls are kept as the record wrote them, except in an object read through Arrow (`arrow`:
    conversations.ArrowRecord), whose null keys are absent ones (_without_nulls). NaN or an infinity is refused."""
    given = value
    if isinstance(value, str) and text:
        value = _parsed(value, where, what)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UsageError(f"{where}: {what} must be a JSON object, got {type(value).__name__}")
    try:  # a lone surrogate inside, as in any text of the record; NaN (allow_nan) as JSON has none
        _text(json.dumps(value, ensure_ascii=False, allow_nan=False), where, what)
    except RecursionError:
        raise UsageError(f"{where}: {what} are nested too deep")
    except (TypeError, ValueError) as e:  # a parquet timestamp, bytes, NaN...
        raise UsageError(f"{where}: {what} cannot be written as JSON ({first_words(e)})")
    return _without_nulls(value) if arrow and not isinstance(given, str) else value


def _without_nulls(value):
    """An object with its null keys left out, at every depth: Arrow (parquet, hub datasets) gives each object of a
    column every key any of them has, the others null, and a template would write `"query": null` into a call that
    never had it. A null key is an absent one, as everywhere in a record; arguments given as JSON text keep theirs."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _tool_calls(turn, where, j, arrow=False):
    """An assistant message's tool calls as chat templates read them and as vLLM hands them to the template when it
    serves: [{"type": "function", "function": {"name", "arguments": {...}}}] ("id" kept where given), or None.
    Arguments given as JSON text are parsed into their object, as vLLM parses them: a template writes them with
    `tojson`, and text would come out as one quoted string the verifier never writes. OpenAI's older
    `function_call` ({name, arguments}) is one such call."""
    calls, legacy = turn.get("tool_calls"), turn.get("function_call")
    if not calls and isinstance(legacy, dict) and legacy:
        calls = [{"type": "function", "function": legacy}]
    elif not calls:
        if legacy and not isinstance(legacy, dict):
            raise UsageError(f"{where}: message {j} 'function_call' must be a call ({{\"name\", \"arguments\"}}), "
                             f"got {type(legacy).__name__}")
        if calls is not None and calls != []:
            raise UsageError(f"{where}: message {j} 'tool_calls' must be a list of calls")
        return None
    if not isinstance(calls, list):
        raise UsageError(f"{where}: message {j} 'tool_calls' must be a list, got {type(calls).__name__}")
    out = []
    for c, call in enumerate(calls):
        what = f"message {j} tool call {c}"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or (call.get("type") or "function") != "function":
            raise UsageError(f"{where}: {what} must be {{\"type\": \"function\", \"function\": {{\"name\", "
                             f"\"arguments\"}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise UsageError(f"{where}: {what} has no function name")
        args = _json_object(fn.get("arguments"), where, f"{what} ({name[:80]!r}) arguments", arrow=arrow)
        made = {"type": "function", "function": {"name": _text(name, where, f"{what} name"), "arguments": args}}
        if isinstance(call.get("id"), str):
            made["id"] = _text(call["id"], where, f"{what} id")
        out.append(made)
    return out


def record_tools(where, record):
    """The record's tool definitions (OpenAI's `tools`, a list of objects, or its JSON text), handed to the chat
    template as apply_chat_template(tools=...) hands them: the template writes them into the prompt, context the
    draft reads but is never trained to write. None where the record has none."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if isinstance(tools, str):
        tools = _parsed(tools, where, "'tools'")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise UsageError(f"{where}: 'tools' must be a list of tool definitions, got {type(tools).__name__}")
    # a null entry is an absent one (Arrow writes one for a shorter list); {} would be written as a tool
    tools = [_json_object(t, where, f"'tools' entry {k}", text=False, arrow=isinstance(record, ArrowRecord))
             for k, t in enumerate(tools) if t is not None]
    return tools or None


def uses_tools(messages, tools):
    """Whether a conversation calls a tool or offers tools: what --regenerate cannot rewrite."""
    return bool(tools) or any(m.get("tool_calls") for m in messages)


def _first(turn, *keys):
    """The first of `keys` whose value is not null: Arrow gives a parquet of both formats every key in every message,
    the other format's null."""
    return next((turn[k] for k in keys if turn.get(k) is not None), None)


def normalize(where, record, through_first_user=False):
    """One record -> (id or None, [{"role", "content"} and, where given, "reasoning_content", an assistant's
    "tool_calls", a tool result's "tool_call_id" and "name"]). Raises UsageError on malformed records.
    `through_first_user`: read no message past the first user turn (stage 05's prompt): what comes later, a tool call
    included, is not looked at."""
    if not isinstance(record, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(record).__name__}")
    # a null field is an absent one: Arrow (parquet, hub datasets) fills the other format's column with null
    if record.get("conversations") is not None or ("conversations" in record and record.get("messages") is None):
        turns, rkey, ckey = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, rkey, ckey = record["messages"], "role", "content"
    else:
        raise UsageError(f"{where}: no 'conversations' (ShareGPT) or 'messages' (OpenAI) field")
    if turns is None:
        turns = []
    if not isinstance(turns, list):
        raise UsageError(f"{where}: '{'conversations' if rkey == 'from' else 'messages'}' must be a list, "
                         f"got {type(turns).__name__}")
    messages = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict):
            raise UsageError(f"{where}: message {j} must be an object, got {type(t).__name__}")
        role = _first(t, rkey, "role", "from")
        if not isinstance(role, str):
            raise UsageError(f"{where}: message {j} has no '{rkey}' string")
        _text(role, where, f"message {j} role")
        if role.lower() not in ROLES:
            raise UsageError(f"{where}: message {j} has unknown role '{role}' "
                             f"(known: {', '.join(sorted(ROLES))})")
        content = _first(t, ckey, "content", "value")  # the other format's key too, as for the role
        role = ROLES[role.lower()]
        calls = _tool_calls(t, where, j, isinstance(record, ArrowRecord)) if role == "assistant" and \
            not through_first_user else None
        if content is None and (t.get("tool_calls") or t.get("function_call")):  # a call alone: OpenAI writes
            content = ""  # its content as null
        message = {"role": role, "content": _content(content, where, j)}
        if calls:  # the call is part of the answer: the template renders it inside the assistant's turn
            message["tool_calls"] = calls
        if role == "tool":  # templates that pair results with their calls read these
            for key in ("tool_call_id", "name"):
                if isinstance(t.get(key), str):
                    message[key] = _text(t[key], where, f"message {j} {key}")
        if isinstance(t.get("reasoning_content"), str):  # reasoning templates render it (Qwen3, DeepSeek-R1, Kimi)
            message["reasoning_content"] = _text(t["reasoning_content"], where, f"message {j} reasoning_content")
        messages.append(message)
        if through_first_user and message["role"] == "user":
            break
    rid = record.get("id", record.get("conversation_id"))
    if isinstance(rid, str):
        rid = _text(rid, where, "'id'")
    elif rid is not None:  # 7 -> "7", {"a": 1} -> '{"a":1}': JSON text, ASCII-escaped, so always writable
        try:
            rid = json.dumps(rid, sort_keys=True, separators=(",", ":"))
        except TypeError:  # a parquet timestamp, bytes, ...
            rid = str(rid)
        except RecursionError:
            raise UsageError(f"{where}: 'id' is nested too deep")
    return rid, messages
