"""Stage 01: chat data -> the verifier's chat template -> token ids with assistant-only loss masks.

Usage:
    python 01_prepare_dataset.py --model-path data/models/smollm2-135m-instruct --dataset sharegpt \
        --num-samples 300 --output-dir data/prepared
    python 01_prepare_dataset.py --config configs/kimi-k2.5-int4.yaml

Inputs:  --model-path (HF folder or hub id: tokenizer + chat template); --dataset (`sharegpt` = the embedded
         ShareGPT, a .jsonl/.json/.parquet file or folder, or a hub dataset id). ShareGPT
         `conversations[{from, value}]` and OpenAI `messages[{role, content}]`, detected per record.
Outputs: --output-dir/tokenized_data.jsonl  one {"id", "input_ids", "loss_mask"} per line
         --output-dir/token_freq.npy        int64 [V] counts of loss-masked tokens per verifier token id
         --output-dir/manifest.json         arguments, verifier fingerprint, counts, versions, command
Selection: the first --num-samples records of the source (so records after them stay held out for
stage 05), written in an order shuffled by --seed. Every assistant turn is trained.
--regenerate: the verifier first rewrites every assistant turn through vLLM (eagle3pipe/regenerate.py), resumably;
         its answers also land in --output-dir/regenerated.jsonl.
The output folder must be new, empty or an earlier stage 01 output: only this stage's own files are replaced.
"""
import collections
import hashlib
import itertools
import json
import os
import random

from eagle3pipe import cli, conversations, files, outdir, regenerate, verifier

def parse_args(argv=None):
    p = cli.Parser(description="Stage 01: tokenize chat data with assistant-only loss masks.")
    p.add_argument("--model-path", help="verifier: HF model folder or hub id (tokenizer + chat template)")
    p.add_argument("--dataset", default="sharegpt", help="'sharegpt', a .jsonl/.json/.parquet file or folder, "
                   "or a hub dataset id")
    p.add_argument("--split", default="train", help="split of a hub dataset")
    p.add_argument("--output-dir", default="data/prepared", help="stage 01 output folder")
    p.add_argument("--max-seq-len", type=int, default=2048, help="truncate each conversation to this many tokens")
    p.add_argument("--num-samples", type=int, default=None, help="use the first N records (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the output row order")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer's own code (Kimi)")
    p.add_argument("--regenerate", action="store_true",
                   help="the verifier (vLLM) rewrites every assistant turn first: on-policy data")
    p.add_argument("--regen-temperature", type=float, default=0.0, help="sampling temperature of --regenerate")
    p.add_argument("--regen-max-tokens", type=int, default=1024, help="longest regenerated turn, in tokens")
    p.add_argument("--regen-batch-size", type=int, default=64,
                   help="prompts per vLLM call; answers are saved after each call (what a killed run keeps)")
    cli.add_dtype_flag(p, "the verifier (with --regenerate)")
    p.add_argument("--regen-tp-size", type=int, default=1, help="tensor-parallel GPUs for --regenerate")
    return cli.parse_args(p, "prepare", argv, required=["model_path"])


def read_conversations(args, log):
    """The selected records, validated before the tokenizer loads: a bad record fails in seconds."""
    info, records, skipped, n = {}, [], collections.Counter(), 0
    source = conversations.iter_records(args.dataset, args.split, info)
    if args.num_samples is not None:  # never read record N+1: a bad record past the selection is not ours to judge
        source = itertools.islice(source, args.num_samples)
    for where, rec in source:
        rid, messages = conversations.normalize(where, rec)
        n += 1
        if not messages:
            skipped["empty"] += 1
        elif not any(m["role"] == "assistant" for m in messages):
            skipped["no_assistant_turn"] += 1
        elif not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            skipped["empty_answers"] += 1  # it would train on the end-of-turn token alone
        else:
            records.append((rid or f"row{n - 1}", messages))
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
    from eagle3pipe import masks
    from eagle3pipe.progress import Progress
    counts = collections.Counter()
    freq = np.zeros(vocab, dtype=np.int64)
    rows, first_template_error, turns = [], None, 0
    bar = Progress(len(records), "prepare", "conversations")
    for rid, messages in records:
        bar.update(1)
        try:
            ids, mask, meta = masks.tokenize_conversation(tok, messages, args.max_seq_len)
        except masks.TemplateTooSlow as e:  # a loop in the template: no record is worth the wait
            raise cli.UsageError(f"record {rid}: {e}")
        except masks.TemplateError as e:
            skipped["template_error"] += 1
            first_template_error = first_template_error or f"{rid}: {e}"
            continue
        counts["unaligned_turns"] += meta["unaligned"]
        counts["truncated"] += meta["truncated"]
        turns += sum(m["role"] == "assistant" for m in messages)
        if not any(mask):
            skipped["nothing_trainable_after_truncation" if meta["truncated"] else
                    "unaligned" if meta["unaligned"] else "nothing_trainable"] += 1
            continue
        if max(ids) >= vocab:
            raise cli.UsageError(f"record {rid}: token id {max(ids)} >= the verifier's vocab size {vocab}; "
                                 f"the tokenizer does not match config.json")
        freq += np.bincount(np.asarray(ids)[np.asarray(mask, dtype=bool)], minlength=vocab)
        bar.tokens += len(ids)
        rows.append({"id": rid, "input_ids": ids, "loss_mask": mask})
    bar.close()
    if records and skipped["template_error"] == len(records):
        raise cli.UsageError(f"--model-path {args.model_path}: its chat template fails on every conversation "
                             f"(first: {first_template_error}); fix the template (tokenizer_config.json or "
                             f"chat_template.jinja)")
    if first_template_error:
        log.warning(f"the chat template refused {skipped['template_error']} conversations, e.g. {first_template_error}")
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


def main():
    args = parse_args()
    log = cli.setup_logging()
    fp, text_cfg = verifier.open_verifier(args.model_path, args.trust_remote_code)
    verifier.check_chat_files(args.model_path)
    verifier.check_positions(f"--max-seq-len {args.max_seq_len}", args.max_seq_len + 1, fp, "rows this long (and the "
                             "position stage 02 reads past one)")
    if args.regenerate:
        regenerate.check(args, text_cfg)
    conversations.check_dataset(args.dataset)
    inputs = [("--model-path", args.model_path), ("--dataset", args.dataset)]
    outdir.check("--output-dir", args.output_dir, "prepare", inputs)
    records, n_read, skipped, info = read_conversations(args, log)
    from eagle3pipe import masks
    tok = masks.load_tokenizer(args.model_path, args.trust_remote_code)
    masks.probe_template(tok, records)  # a template that loops is refused before the folder is taken
    out, regen = None, None
    if args.regenerate:  # its answers are cached in the folder as they come: it is taken first
        out = outdir.claim("--output-dir", args.output_dir, "prepare", inputs)  # held until the process exits
        records, counts_regen, answers = regenerate.run(records, tok, args, out)
        regen = {"settings": regenerate.settings_of(args), **counts_regen}
        log.info(f"regenerated {counts_regen['turns_regenerated']:,} assistant turns "
                 f"({counts_regen['turns_from_cache']:,} from an earlier run)")
    rows, freq, counts = tokenize_rows(records, tok, args, fp["vocab_size"], skipped, n_read, log)
    if out is None:  # every refusal the rows can cause came first: a refused run leaves no folder behind
        out = outdir.claim("--output-dir", args.output_dir, "prepare", inputs)
    random.Random(args.seed).shuffle(rows)

    tokens = sum(len(r["input_ids"]) for r in rows)
    stats = {"records_read": n_read, "rows": len(rows), "skipped": dict(skipped), "tokens": tokens,
             "loss_tokens": int(freq.sum()), "max_row_tokens": max(len(r["input_ids"]) for r in rows),
             "max_token_id": max(max(r["input_ids"]) for r in rows), **counts}
    files.begin_output(out)
    digest = hashlib.sha256()
    with files.atomic_path(os.path.join(out, "tokenized_data.jsonl")) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            line = json.dumps(r, separators=(",", ":")) + "\n"
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
        "prepare", args, content_id=digest.hexdigest()[:16], verifier=fp, source=dict(info), counts=stats,
        regenerated=regen, token_freq_id=files.array_id(freq)))
    log.info(f"wrote {len(rows)} rows, {tokens:,} tokens ({stats['loss_tokens']:,} trained, "
             f"{stats['loss_tokens'] / tokens:.1%}) to {args.output_dir}; skipped {sum(skipped.values())} "
             f"{dict(skipped)}; truncated {counts['truncated']}")


if __name__ == "__main__":
    cli.run(main)
