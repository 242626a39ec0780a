"""Stage 01's steps: the selected records read and checked, each conversation through the chat template into rows
with assistant-only loss masks, and the folder's files written (tokenized_data.jsonl, token_freq.npy, manifest)."""
import array
import collections
import contextlib
import hashlib
import itertools
import json
import logging
import os
import random

from . import regenerate
from ..base import devices, faults
from ..base.progress import Progress
from ..chat import conversations, messages as chat, tokenize_workers, masks
from ..config import cli
from ..storage import files, outdir
from ..verifier import verifier
from ..verifier.verifier_weights import verify

log = logging.getLogger("eagle3")


def check(args):
    """Every flag and input, in seconds, before the tokenizer loads: the verifier's config and chat files, the
    positions a row needs, --regenerate's settings, the dataset, the output folder. -> (fingerprint, inputs)."""
    fp, text_cfg = verifier.open_verifier(args.model_path, args.trust_remote_code)
    verifier.check_chat_files(args.model_path)
    verifier.check_positions(f"--max-seq-len {args.max_seq_len}", args.max_seq_len + 1, fp, "rows this long (and the "
                             "position stage 02 reads past one)")
    if args.regenerate:
        regenerate.check(args, text_cfg)
    conversations.check_dataset(args.dataset)
    cores = devices.cores()
    if args.num_workers is not None and args.num_workers > 2 * cores:  # a typo, or another machine's value
        raise cli.UsageError(f"--num-workers {args.num_workers}: more than twice the {cores} CPU cores this process "
                             f"may use; each worker renders and tokenizes on one core")
    inputs = [("--model-path", args.model_path), ("--dataset", args.dataset)]
    outdir.check("--output-dir", args.output_dir, "prepare", inputs)
    return fp, inputs


def tokenizer(args, records):
    """The verifier's tokenizer, its chat template probed on the records: a template that loops is refused before
    the folder is taken. With --regenerate the verifier's weights are checked against its config first."""
    if args.regenerate:  # the verifier answers: its weights against the model its config defines (imports
        verifier.check_weights(args.model_path)  # transformers; said by regenerate.run, once the folder is taken)
        verify(args.model_path, args.trust_remote_code)
        regenerate.check_engine(args)
    tok = masks.load_tokenizer(args.model_path, args.trust_remote_code)
    tokenize_workers.probe(tok, records, args.max_seq_len)
    return tok


def check_marks(args, rows, skipped, rendered):
    """Fail closed on a template that marks no assistant text: every rendered conversation with nothing to train
    (a render with its answer adds nothing to the render that asks for it), or every kept token trained (no prompt around the answers) is the
    template's doing, and training on an all-zero or all-one mask would teach the draft nothing of the verifier's."""
    where = f"--model-path {args.model_path}: its chat template"
    # (turns a template renders elsewhere than a render up to them puts them, "unaligned", have their own line)
    if rendered and not rows and skipped["nothing_trainable"] == rendered:
        raise cli.UsageError(f"{where} marks no assistant turn in any of the {rendered:,} conversations it rendered "
                             f"(the render with an answer adds nothing to the render that asks for it); fix the "
                             f"template (tokenizer_config.json or chat_template.jinja)")
    if rendered and not rows and skipped["answers_rendered_empty"] == rendered:
        raise cli.UsageError(f"--model-path {args.model_path}: no answer's text reaches a trained token in any of the "
                             f"{rendered:,} conversations (only end-of-turn markers would train): its chat template "
                             f"renders the answers empty, or its tokenizer drops their text (an empty vocabulary, a "
                             f"normalizer that erases it)")
    if rows and all(all(r["loss_mask"]) for r in rows):
        raise cli.UsageError(f"{where} renders the {len(rows):,} conversations as answer text alone: every token of "
                             f"every row would be trained, no prompt is context; fix the template "
                             f"(tokenizer_config.json or chat_template.jinja)")


def read_conversations(args, log):
    """The selected records, validated before the tokenizer loads: a bad record fails in seconds."""
    info, records, skipped, n = {}, [], collections.Counter(), 0
    source = conversations.iter_records(args.dataset, args.split, info)
    if args.num_samples is not None:  # never read record N+1: a bad record past the selection is not ours to judge
        source = itertools.islice(source, args.num_samples)
    for where, rec in source:
        rid, messages = chat.normalize(where, rec)
        tools = chat.record_tools(where, rec)
        n += 1
        if args.regenerate and chat.uses_tools(messages, tools):
            # the verifier's new answer would not make the call the next messages answer
            raise cli.UsageError(f"{where}: --regenerate rewrites chat, not tool use: this record "
                                 f"{'calls a tool' if any(m.get('tool_calls') for m in messages) else 'offers tools'}"
                                 f"; leave such records out, or drop --regenerate")
        if not messages:
            skipped["empty"] += 1
        elif not any(m["role"] == "assistant" for m in messages):
            skipped["no_assistant_turn"] += 1
        elif not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in messages):
            skipped["empty_answers"] += 1  # it would train on the end-of-turn token alone
        else:
            records.append((rid or f"row{n - 1}", messages, tools))
    if not records:
        raise cli.UsageError(f"--dataset {args.dataset}: no trainable conversation among {n} records "
                             f"(skipped: {dict(skipped)})")
    log.info(f"read {n} records from {info.get('source_file', args.dataset)}"
             + (" (the file is truncated; stopped at its last complete record)" if info.get("truncated_source")
                and args.num_samples is None else ""))
    if args.num_samples is not None and n < args.num_samples:
        log.warning(f"--num-samples {args.num_samples}: --dataset {args.dataset} holds {n} records; taking all of them")
    return records, n, skipped, info


def tokenize_rows(records, tok, args, vocab, skipped, n_read, log):
    """Each conversation through the chat template -> (rows [{"id", "input_ids", "loss_mask"}], loss-masked counts
    per token id, counts); what cannot train is counted in `skipped`. A template that fails on every conversation is
    the verifier's problem, not the data's, and is refused naming it."""
    import numpy as np
    counts = collections.Counter()
    freq = np.zeros(vocab, dtype=np.int64)
    rows, first_template_error, turns = [], None, 0
    calling, first_dropped = 0, None  # records with a tool call; the first whose call the template drops
    workers = tokenize_workers.count(args.num_workers, len(records), args.regenerate)
    if workers > 1:
        log.info(f"rendering and tokenizing in {workers} worker processes (--num-workers)")
    bar = Progress(len(records), "prepare", "conversations")
    results = tokenize_workers.outcomes(records, tok, args.max_seq_len, workers)  # in the records' order
    with contextlib.closing(results):  # a refusal below ends the workers too
        for (rid, messages, tools), (kind, *result) in zip(records, results):
            bar.update(1)
            faults.kill_point("tokenize")  # the stage itself, its workers busy (tests/reliability)
            faults.signal_point("tokenize")
            calling += any(m.get("tool_calls") for m in messages)
            if kind in ("slow", "panic"):  # a loop in the template, a tokenizer's panic: the verifier's files' fault
                raise cli.UsageError(f"record {rid}: {result[0]}")
            if kind == "crash":  # a worker's unexpected failure, raised here as one process raises it
                raise result[0]
            if kind == "dropped":  # trained, the answer would end where the verifier calls
                skipped["tool_calls_not_rendered"] += 1
                first_dropped = first_dropped or f"record {rid}: {result[0]}"
                continue
            if kind == "error":
                skipped["template_error"] += 1
                first_template_error = first_template_error or f"{rid}: {result[0]}"
                continue
            ids, mask, meta = result
            counts["opening_turns_dropped"] += meta.get("opening_turns_dropped", 0)
            counts["unaligned_turns"] += meta["unaligned"]
            counts["untrained_after_stop"] += meta.get("after_stop", 0)
            counts["truncated"] += meta["truncated"]
            turns += sum(m["role"] == "assistant" for m in messages)
            if not any(mask):
                skipped["nothing_trainable_after_truncation" if meta["truncated"] else
                        "unaligned" if meta["unaligned"] else "nothing_trainable"] += 1
                continue
            if not meta["answered"]:  # its answers have text, the trained tokens none: the template's or tokenizer's
                skipped["answers_rendered_empty"] += 1
                continue
            if max(ids) >= vocab:
                raise cli.UsageError(f"record {rid}: token id {max(ids)} >= the verifier's vocab size {vocab}; "
                                     f"the tokenizer does not match config.json")
            np.add.at(freq, np.asarray(ids)[np.asarray(mask, dtype=bool)], 1)  # O(row), not O(vocab) a row
            bar.tokens += len(ids)
            # held as 4- and 1-byte arrays until written: a list of ints costs about 40 bytes a token (the 23.9M tokens
            # of the embedded data took 1.5 GB; a 700M-token run would take 30 GB)
            rows.append({"id": rid, "input_ids": array.array("i", ids), "loss_mask": array.array("b", mask)})
    bar.close()
    if records and skipped["template_error"] == len(records):
        raise cli.UsageError(f"--model-path {args.model_path}: its chat template fails on every conversation "
                             f"(first: {first_template_error}); fix the template (tokenizer_config.json or "
                             f"chat_template.jinja)")
    if calling and skipped["tool_calls_not_rendered"] == calling:
        raise cli.UsageError(f"--model-path {args.model_path}: its chat template renders no tool call ({calling:,} of "
                             f"the records call tools; first: {first_dropped}); leave records with tool calls out, or "
                             f"give a template that renders them (docs/STAGES.md, stage 01)")
    if first_dropped:
        log.warning(f"the chat template drops a tool call of {skipped['tool_calls_not_rendered']:,} of {calling:,} "
                    f"records that call tools, e.g. {first_dropped}: those records are left out")
    if first_template_error:
        log.warning(f"the chat template refused {skipped['template_error']} conversations, e.g. {first_template_error}")
    if counts["opening_turns_dropped"]:
        log.info(f"the chat template refuses a conversation that an assistant turn opens: "
                 f"{counts['opening_turns_dropped']:,} such opening turns were left out (they answer nothing), the rest "
                 f"of their conversations kept (opening_turns_dropped in the manifest)")
    check_marks(args, rows, skipped, len(records) - skipped["template_error"] - skipped["tool_calls_not_rendered"])
    if counts["unaligned_turns"]:  # the template's doing, not the data's: say it whatever the share
        what = (f"--model-path {args.model_path}: its chat template renders {counts['unaligned_turns']:,} of "
                f"{turns:,} assistant turns where no render up to them puts them (it moves or drops earlier text)")
        if not rows:
            raise cli.UsageError(f"{what}; no conversation has a turn left to train (docs/STAGES.md, stage 01)")
        log.warning(f"{what}: those turns are left untrained (counted as unaligned_turns in the manifest)")
    if not rows:
        raise cli.UsageError(f"--dataset {args.dataset}: no trainable conversation among {n_read} records "
                             f"(skipped: {dict(skipped)})")
    return rows, freq, counts


def write(out, args, fp, rows, freq, counts, skipped, n_read, info, regen, answers, log):
    """The rows in an order shuffled by --seed, token_freq.npy, the verifier's answers (with --regenerate) and the
    manifest last, each file whole or absent."""
    random.Random(args.seed).shuffle(rows)
    tokens = sum(len(r["input_ids"]) for r in rows)
    stats = {"records_read": n_read, "rows": len(rows), "skipped": dict(skipped), "tokens": tokens,
             "loss_tokens": int(freq.sum()), "max_row_tokens": max(len(r["input_ids"]) for r in rows),
             "max_token_id": max(max(r["input_ids"]) for r in rows), **counts}
    files.begin_output(out)
    digest = hashlib.sha256()
    with files.atomic_path(os.path.join(out, "tokenized_data.jsonl")) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            row = {"id": r["id"], "input_ids": r["input_ids"].tolist(), "loss_mask": r["loss_mask"].tolist()}
            line = json.dumps(row, separators=(",", ":")) + "\n"
            digest.update(line.encode())
            f.write(line)
    files.save_npy(os.path.join(out, "token_freq.npy"), freq)
    regen_file = os.path.join(out, "regenerated.jsonl")
    if regen:  # the verifier's answers, for inspection and for a rerun's cache
        with files.atomic_path(regen_file) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(a) + "\n" for a in answers)
    for stale in ([regen_file] if not regen else []) + [regenerate.cache_path(out)]:
        outdir.remove(stale)  # an earlier run's: only if the record says this stage made it
    # content_id: later stages key their resume on what the rows are, not on when they were written
    files.write_json(os.path.join(out, files.MANIFEST), files.manifest(
        "prepare", args, content_id=digest.hexdigest()[:16], verifier=fp, source=dict(info),
        counts=stats, regenerated=regen, token_freq_id=files.array_id(freq)))
    log.info(f"wrote {len(rows)} rows, {tokens:,} tokens ({stats['loss_tokens']:,} trained, "
             f"{stats['loss_tokens'] / tokens:.1%}) to {args.output_dir}; skipped {sum(skipped.values())} "
             f"{dict(skipped)}; truncated {counts['truncated']}")
