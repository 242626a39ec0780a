"""Stage 02's output folder: the run's identity (refusing another run's files), --overwrite, the per-replica shard
reports, the final check of every file and manifest.json."""
import json
import logging
import os
import shutil
import time

from . import cli, faults, files, verifier

log = logging.getLogger("eagle3")
SHARD_REPORT = ".shard-{}-of-{}.json"  # one per replica, written when it finishes


def read_rows(jsonl, expected, vocab_size):
    """Stage 01's rows, each checked (before the model loads): a list of token ids inside the verifier's vocab."""
    rows = []
    with open(jsonl, "rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                ids = json.loads(line)["input_ids"]
                if not ids or min(ids) < 0 or max(ids) >= vocab_size:
                    raise ValueError(f"token ids must be in [0, {vocab_size}), got "
                                     f"{'none' if not ids else f'{min(ids)}..{max(ids)}'}")
                rows.append(ids)
            except (ValueError, KeyError, TypeError) as e:
                raise cli.UsageError(f"{jsonl}:{lineno}: malformed row ({e}); rerun 01_prepare_dataset.py")
    if len(rows) != expected:
        raise cli.UsageError(f"{jsonl}: {len(rows)} rows, its manifest says {expected}; rerun 01_prepare_dataset.py")
    return rows


def prepare_output(args, plan):
    """Refuse files from a different run (other layers/verifier/rows); then, unless --dry-run, create the
    folder and honour --overwrite."""
    out = args.output_dir
    identity = {"verifier": {k: plan["verifier"][k] for k in verifier.IDENTITY}, "layer_ids": plan["layer_ids"],
                "prepared": plan["prepared_manifest"]["content_id"], "rows": plan["rows"],
                # "bfloat16": the name folders written before fp8 existed carry, so they still resume
                "storage_dtype": {"bf16": "bfloat16"}.get(args.storage_dtype, args.storage_dtype)}
    run_file = os.path.join(out, files.RUN_FILE)
    if not args.overwrite and os.path.isdir(out):
        old = files.read_manifest(out) or (files.read_json(run_file) if os.path.exists(run_file) else None)
        old = old.get("identity", old) if old else None
        if old and old != identity:
            what = next(k for k in identity if old.get(k) != identity[k])
            raise cli.UsageError(f"--output-dir {out}: holds hidden states of another run ({what} differs); "
                                 f"use --overwrite or another folder")
    if args.dry_run:
        return identity
    if args.overwrite and os.path.isdir(out):
        for name in os.listdir(out):
            if name.startswith(("hs_", ".hs_", ".run.json", ".incoming", ".shard-", files.MANIFEST)):
                path = os.path.join(out, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        log.info(f"--overwrite: removed this stage's files from {out}")
    os.makedirs(out, exist_ok=True)
    files.write_json(run_file, {"stage": "extract", "identity": identity})
    return identity


def finish(args, plan, identity, rows, failed, stats):
    """Write manifest.json once every row is accounted for. A shard first writes its own report; the replica that
    completes the set (or `--verify`) checks every file of every shard and writes the folder's manifest."""
    from . import extraction
    out, (n_states, hidden) = args.output_dir, (plan["n_states"], plan["hidden_size"])
    if args.shard and not args.verify:
        i, n = args.shard
        files.write_json(os.path.join(out, SHARD_REPORT.format(i, n)), {"shard": [i, n], "identity": identity, **stats,
                                                                         "failures": {str(k): v for k, v in failed.items()}})
    if args.shard or args.verify:
        reports = [files.read_json(os.path.join(out, f)) for f in sorted(os.listdir(out)) if f.startswith(".shard-")]
        reports = [r for r in reports if r.get("identity") == identity]
        n = max([r["shard"][1] for r in reports] + [1])
        have = {r["shard"][0] for r in reports}
        if args.shard and len(have) < n:
            log.info(f"shard {args.shard[0]}/{n} done; the manifest is written when all {n} shards are")
            return 1 if failed else 0
        failed = {int(k): v for r in reports for k, v in r["failures"].items()} if reports else dict(failed)
        t0 = time.time()
        bad = {i: r for i, r in extraction.check_all(out, rows, [i for i in range(len(rows)) if i not in failed],
                                                     n_states, hidden).items() if r}
        log.info(f"verified {len(rows) - len(failed):,} files in {time.time() - t0:.0f} s (checksums, token ids, values)")
        if bad:
            i, reason = next(iter(bad.items()))
            shards = ", ".join(f"{k}/{n}" for k in sorted({j % n for j in bad}))
            log.error(f"{len(bad)} rows have no valid file, e.g. hs_{i}.safetensors: {reason}; "
                      f"{f'rerun shard(s) {shards}' if n > 1 else 'rerun stage 02'} with the same flags "
                      f"(it redoes only those)")
            return 1
        stats = {"tokens": sum(r["tokens"] for r in reports), "seconds": max((r["seconds"] for r in reports), default=0),
                 "resumed": sum(r["resumed"] for r in reports), "shards": n} if reports else stats
    ok, tokens, secs = len(rows) - len(failed), stats["tokens"], stats["seconds"]
    bytes_written = sum(len(rows[i]) for i in range(len(rows)) if i not in failed) * plan["disk_per_token"]
    faults.kill_point("end")
    files.write_json(os.path.join(out, files.MANIFEST), files.manifest(
        "extract", args, identity=identity, content_id=files.content_id(identity), verifier=plan["verifier"],
        layer_ids=plan["layer_ids"], layer_id_convention=verifier.LAYER_ID_CONVENTION, storage_dtype=args.storage_dtype,
        prepared_data=os.path.abspath(plan["jsonl"]),
        counts={"rows": len(rows), "ok": ok, "failed": len(failed), "resumed": stats["resumed"],
                "extracted": ok - stats["resumed"], "tokens_extracted": tokens, "bytes": bytes_written,
                "shards": stats.get("shards", 1)},
        throughput={"seconds": round(secs, 2), "tokens_per_s": round(tokens / secs, 1) if secs else None},
        failures={str(i): r for i, r in sorted(failed.items())}, complete=not failed))
    log.info(f"done: {ok} ok, {len(failed)} failed, {stats['resumed']} resumed; {tokens:,} tokens in {secs:.0f} s "
             f"({tokens / max(secs, 1e-9):,.0f} tok/s); {bytes_written / 1e9:.2f} GB in {out}")
    if failed:
        log.error(f"{len(failed)} samples failed (reasons in {out}/manifest.json); stage 04 trains on the others")
    return 1 if failed else 0
