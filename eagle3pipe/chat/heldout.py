"""Which prompts stage 05 measures on: held out from every record the draft trained on.

Prompts default to ShareGPT conversations after the records stage 01 read; a file or folder of the dataset stage 01
read skips its records among them; `--prepared-data` must be the stage 01 output the draft trained on (its content id
in the draft's stage 04 manifest), and a path given that does not exist is refused. Each prompt is a conversation's
first user turn, after any system turn.
"""
import itertools
import json
import os
import re

from ..base.errors import UsageError, quote
from ..storage.files import load_stage, read_json
from .conversations import dataset_files, iter_records
from .messages import normalize, record_tools


def train_manifest(draft):
    """The manifest of the stage 04 run a checkpoint came from, or {}."""
    path = os.path.join(os.path.dirname(os.path.realpath(draft)), "manifest.json")
    try:
        man = read_json(path) if os.path.isfile(path) else {}
    except UsageError:
        return {}
    return man if isinstance(man, dict) and man.get("stage") == "train" else {}


PREPARED_DEFAULT = "data/prepared"  # stage 05's --prepared-data when none is given


def recorded_prepared(drafts):
    """The one stage 01 output the drafts' stage 04 manifests say they trained on, if it exists, else None."""
    inputs = [train_manifest(path).get("inputs") for _, path in drafts]  # a manifest is the user's file: any shape
    recorded = {i.get("prepared_data") for i in inputs if isinstance(i, dict)}
    recorded = {r for r in recorded if isinstance(r, str)}
    return next(iter(recorded)) if len(recorded) == 1 and os.path.isdir(next(iter(recorded))) else None


def held_out_skip(prompts, prepared_data, drafts=()):
    """How many leading records of `prompts` stage 01 trained on, to skip: every one of them when --prepared-data's
    dataset is the same source (paths compared resolved, against the folder stage 01 ran in). -> (skip, a warning or
    None). A --prepared-data that is not a stage 01 folder is refused: evaluating on training data would go unseen.
    The default folder may be absent (prompts of a source stage 01 never read: a warning); a path the operator gave
    (a flag, a config key) that does not exist is a typo until they say otherwise, and refused. `drafts`: [(name,
    path)]; a draft whose stage 04 manifest says it trained on another stage 01 output than --prepared-data is
    refused (that output's records are the ones to skip)."""
    def field(man, section, key):  # a manifest is the user's file: any shape
        value = man.get(section)
        return value.get(key) if isinstance(value, dict) and isinstance(value.get(key), str) else None
    trained_from = {path: train_manifest(path) for _, path in drafts}
    if not os.path.exists(prepared_data):
        if prepared_data != PREPARED_DEFAULT:
            raise UsageError(f"--prepared-data {prepared_data}: not found; give stage 01's folder (the records it "
                             f"trained on are skipped), or leave --prepared-data out to evaluate --prompts from its "
                             f"first record")
        recorded = sorted({field(m, "inputs", "prepared_data") for m in trained_from.values()} - {None})
        own = recorded_prepared(drafts)
        if own:  # the draft's own: its content id is checked below
            note = (f"--prepared-data {prepared_data}: not found; using {quote(own)}, the stage 01 output the draft "
                    f"trained on")
            skip, warning = held_out_skip(prompts, own, drafts)
            return skip, "; ".join(w for w in (note, warning) if w)
        hint = f" (the draft's run read {', '.join(map(quote, recorded))})" if recorded else ""
        return 0, (f"--prepared-data {prepared_data}: not found, so which records of --prompts stage 01 trained on "
                   f"is unknown; evaluating from the first record (give stage 01's folder to skip them{hint})")
    prep = load_stage("--prepared-data", prepared_data, "prepare")
    for path, man in trained_from.items():
        ident, where = field(man, "identity", "prepared"), field(man, "inputs", "prepared_data")
        if ident and prep.get("content_id") and ident != prep["content_id"]:
            raise UsageError(f"--prepared-data {prepared_data}: not the stage 01 output --draft {path} trained on "
                             f"(its run read {quote(where) if where else 'another'}, content {ident}; this one is "
                             f"{prep['content_id']}): the records to skip are that one's; give it")

    def source(name, cwd):
        path = os.path.join(cwd or os.getcwd(), name) if isinstance(name, str) else None
        return os.path.realpath(path) if path and os.path.exists(path) else name
    trained, asked, read = source(prep["args"].get("dataset"), prep.get("cwd")), source(prompts, None), \
        prep["counts"]["records_read"]
    if trained == asked:
        return read, None
    if not (isinstance(trained, str) and os.path.isabs(trained) and os.path.isabs(asked)):
        return 0, None  # a hub id or the embedded source against another: no record in common
    if asked.startswith(trained.rstrip(os.sep) + os.sep):  # a file or folder of the folder stage 01 read
        return _trained_within(trained, asked, read), None
    if trained.startswith(asked.rstrip(os.sep) + os.sep):
        raise UsageError(f"--prompts {prompts}: holds the dataset stage 01 trained on ({trained}, --prepared-data "
                         f"{prepared_data}) among other records, which cannot be told apart by their order: give "
                         f"a file or folder stage 01 did not read")
    return 0, None


def _trained_within(folder, part, read):
    """How many leading records of `part` (a file or folder inside the dataset folder stage 01 read) were among
    the first `read` records of `folder`, which stage 01 read file after file in dataset_files' order."""
    before = 0
    for path in dataset_files(folder, "--prepared-data's dataset"):
        real = os.path.realpath(path)
        if real == part or real.startswith(part.rstrip(os.sep) + os.sep):
            left = max(0, read - before)  # part's files come one after another in that order
            return sum(1 for _ in itertools.islice(iter_records(part, flag="--prompts"), left))
        if before >= read:
            return 0
        before += sum(1 for _ in iter_records(path, flag="--prepared-data's dataset"))
    return 0


SAMPLE = re.compile(r"#sample\d+$")  # stage 01 --regen-samples: a record's further sampled copies, "<id>#sample<n>"


def trained_ids(prepared):
    """The record ids stage 01 wrote rows for (`prepared`: its folder, or None), those a record carried itself
    ("row<n>", a position, says nothing across files); a sampled copy's row counts as its record's."""
    path = os.path.join(prepared, "tokenized_data.jsonl") if prepared else None
    if not path or not os.path.isfile(path):
        return set()
    found, decode = set(), json.JSONDecoder().raw_decode
    with open(path, encoding="utf-8") as f:
        for line in f:  # '{"id":"...",' opens every row: the rest, the tokens, is never parsed
            try:
                rid = decode(line, 6)[0] if line.startswith('{"id":') else None
            except ValueError:
                continue
            if isinstance(rid, str):
                rid = SAMPLE.sub("", rid)
                if not re.fullmatch(r"row\d+", rid):
                    found.add(rid)
    return found


def select_prompts(args, skip, wheres=None, trained=frozenset(), seen=None, tools=None):
    """First user turn (with any system turn before it) of conversations from --prompts, after `skip` records
    (the range stage 01 trained on, for the default ShareGPT source). `wheres`: a list that gets each prompt's
    record ("file:line"); `tools`: one that gets each prompt's tool definitions (None where it has none), which the
    template writes into the prompt as it does in training. `trained`: record ids stage 01 trained on; a record
    carrying one (a copy of its data under another path) is skipped and counted in `seen["trained"]`."""
    prompts, n = [], 0
    for where, rec in iter_records(args.prompts, flag="--prompts"):
        n += 1
        if n <= skip:
            continue
        rid, msgs = normalize(where, rec, through_first_user=True)  # later turns are not the prompt's business
        if trained and rid in trained:
            if seen is not None:
                seen["trained"] = seen.get("trained", 0) + 1
            continue
        user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        head = [m for m in msgs[:user] if m["role"] == "system"] + [msgs[user]] if user is not None else []
        if head and head[-1]["content"].strip():
            prompts.append(head)
            if wheres is not None:
                wheres.append(where)
            if tools is not None:
                tools.append(record_tools(where, rec))
        if len(prompts) >= args.num_prompts:
            break
    if not prompts:
        copies = (seen or {}).get("trained")
        raise UsageError(f"--prompts {args.prompts}: no usable prompt (a user turn) after skipping {skip} records"
                         + (f" and {copies} that carry the ids of records stage 01 trained on" if copies else ""))
    return prompts
