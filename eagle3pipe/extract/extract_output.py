"""Stage 02's output folder: the files it owns, the run's identity (refusing another run's files), --overwrite, the
per-replica shard reports, the final check of every file and manifest.json."""
import contextlib
import logging
import os
import re
import time

from ..base import faults
from ..base.errors import UsageError
from ..engines import engines
from ..formats.hidden_states import hs_path, read_header
from ..formats.spool import clear_spool
from ..storage import files, locks, outdir
from ..storage.input_watch import stage01
from ..verifier import verifier
from ..verifier.verifier_weights import verify

log = logging.getLogger("eagle3")
SHARD_REPORT = ".shard-{}-of-{}.json"  # one per replica, written when it finishes
INCOMING = ".incoming"  # vLLM's connector writes here (a sub-folder per process); our writer renames into place


def engine_log(shard=None):
    """The vLLM engine's log in the output folder: one per declared replica, so replicas never share one."""
    return f"engine.shard-{shard[0]}-of-{shard[1]}.log" if shard else "engine.log"


def prepare_output(args, plan):
    """Refuse files from a different run (other layers/verifier/rows); then, unless --dry-run, take the folder
    (outdir.claim: the lock, --overwrite) and record this run's identity. -> (identity, the real output path)."""
    out = args.output_dir
    identity = {"verifier": {k: plan.verifier[k] for k in verifier.IDENTITY}, "layer_ids": plan.layer_ids,
                "prepared": plan.prepared_manifest["content_id"], "rows": plan.rows,
                # "bfloat16": the name folders written before fp8 existed carry, so they still resume
                "storage_dtype": {"bf16": "bfloat16"}.get(args.storage_dtype, args.storage_dtype)}
    if args.shard and os.path.isdir(out) and not args.overwrite:  # every replica splits the rows the same way
        done = os.path.join(out, files.MANIFEST)
        if os.path.isfile(done) and not os.path.islink(done):  # a finished run: its manifest's split is the split
            try:
                split = files.read_json(done).get("counts", {}).get("shards", 1)
            except (UsageError, ValueError, AttributeError):
                split = None  # not a manifest to go by: the ownership checks name it
            if split is not None and split != args.shard[1]:
                raise UsageError(f"--shard {args.shard[0]}/{args.shard[1]}: {out} holds a finished run split "
                                 f"{split} way{'s' if split != 1 else ''} (its {files.MANIFEST}); a replica of "
                                 f"another split would take that manifest away until every replica ran: "
                                 f"{'drop --shard' if split == 1 else f'give --shard I/{split}'}, or --overwrite")
        for name in sorted(os.listdir(out)):
            m = re.fullmatch(r"\.(?:eagle3\.)?shard-(\d+)-of-(\d+)\.(?:json|lock)", name)
            if m and int(m.group(2)) != args.shard[1]:
                raise UsageError(f"--shard {args.shard[0]}/{args.shard[1]}: {out} is split {m.group(2)} ways by "
                                 f"earlier replicas ({name}); give every replica the same count")
    if args.verify and not any(os.path.isfile(os.path.join(out, name)) for name in (files.RUN_FILE, "manifest.json")):
        # verifying an empty folder took it (lock, ownership record) and failed on every row, exit 1
        raise UsageError(f"--output-dir {out}: no extraction to verify here (--verify checks the files a stage 02 "
                         f"run wrote); run without --verify")
    inputs = [("--model-path", args.model_path), ("--prepared-data", args.prepared_data)]
    files.take_output("--output-dir", out, "extract", identity, inputs, "hidden states", args.shard, args.overwrite,
                      dry_run=True)  # its refusals only: every light one before the check that imports transformers
    weights = verify(args.model_path, args.trust_remote_code)  # the verifier's tensors against its config
    if weights:
        print(f"  weights: {weights}", flush=True)
    out, _ = files.take_output(
        "--output-dir", out, "extract", identity, inputs, "hidden states", args.shard, args.overwrite, args.dry_run,
        begin=not args.verify,  # the manifest comes back once every row is accounted for
        # the compute dtypes of the runs whose files are here (a resumed folder may mix them; the manifest says so);
        # a folder from before --dtype was computed in bf16
        carry=lambda old: {"compute_dtypes": old.get("compute_dtypes", ["bfloat16"])
                           if isinstance(old, dict) and old.get("identity") == identity else []})
    if args.dry_run:
        return identity, out
    staging = os.path.join(out, INCOMING)
    for pid in os.listdir(staging) if outdir.owned(staging) else []:  # our engine's leftovers from dead runs
        if pid.isdigit() and not locks.pid_alive(int(pid)) and outdir.owned(os.path.join(staging, pid)):
            clear_spool(os.path.join(staging, pid))
            outdir.remove(os.path.join(staging, pid))
    return identity, out


def computed_dtypes(out, plan, extracted):
    """The compute dtypes of the runs that wrote files here: the run file's record, with this run's added (there too)
    if it extracted any row. Every dtype is recorded, not refused: a resumed folder may mix them (another machine,
    another --dtype), and its files are bf16 whatever computed them; the manifest lists them all."""
    run_file = os.path.join(out, files.RUN_FILE)
    record = files.read_json(run_file) if os.path.exists(run_file) else {}
    dtypes = set(record.get("compute_dtypes", [])) if isinstance(record, dict) else set()
    if extracted and plan.compute.dtype not in dtypes:
        dtypes.add(plan.compute.dtype)
        files.write_json(run_file, {**record, "compute_dtypes": sorted(dtypes)})
    return sorted(dtypes)


def largest_scale(out, ok):
    """The largest fp8 scale the folder's files hold, from the scale_max each file's header records (a header read
    each: about a second for 17,600 files); None where a file records none (written before it was recorded). Stage 04
    refuses a file whose scales reach past it (hidden_states.scales_outside)."""
    largest = 0.0
    for i in ok:
        note = (read_header(hs_path(out, i))[0].get("__metadata__") or {}).get("scale_max")
        try:
            largest = max(largest, float(note))
        except (TypeError, ValueError):
            return None
    return largest if ok else None


def record_compute_dtype(out, plan):
    """Before the first file of a run: its compute dtype into the run record, so a run killed or stopped before its
    manifest still counts once a rerun under another --dtype finishes the folder."""
    computed_dtypes(out, plan, True)


def finish(args, plan, identity, rows, failed, stats):
    """Write manifest.json once every row is accounted for. A shard first writes its own report; the replica that
    completes the set (or `--verify`) checks every file of every shard and writes the folder's manifest."""
    from . import extraction  # here, not at the top: it imports numpy (the dry run and preflight never need it)
    out, (n_states, hidden) = args.output_dir, (plan.n_states, plan.hidden_size)
    stage01("--prepared-data", plan.jsonl, plan.prepared_manifest).check(full=True)  # the rows this folder was made from
    dtypes = computed_dtypes(out, plan, stats["tokens"] > 0)
    if args.shard and not args.verify:
        i, n = args.shard
        files.write_json(os.path.join(out, SHARD_REPORT.format(i, n)), {"shard": [i, n], "identity": identity, **stats,
                                                                         "failures": {str(k): v for k, v in failed.items()},
                                                                         "compute_dtypes": dtypes})
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
            log.error(f"{len(bad)} rows have no valid file, e.g. hs_{i}.safetensors: {reason}; move the bad "
                      f"files away, then {f'rerun shard(s) {shards}' if n > 1 else 'rerun stage 02'} with the same "
                      f"flags (it makes only the missing ones again)")
            return 1
        stats = {"tokens": sum(r["tokens"] for r in reports), "seconds": max((r["seconds"] for r in reports), default=0),
                 "resumed": sum(r["resumed"] for r in reports), "shards": n} if reports else stats
        dtypes = sorted(set(dtypes).union(*(r.get("compute_dtypes", []) for r in reports)))
    ok, tokens, secs = len(rows) - len(failed), stats["tokens"], stats["seconds"]
    scale_max = largest_scale(out, [i for i in range(len(rows)) if i not in failed]) if args.storage_dtype == "fp8" \
        else None
    bytes_written = sum(len(rows[i]) for i in range(len(rows)) if i not in failed) * plan.disk_per_token
    faults.kill_point("end")
    files.write_json(os.path.join(out, files.MANIFEST), files.manifest(
        "extract", args, identity=identity, content_id=files.content_id(identity), verifier=plan.verifier,
        layer_ids=plan.layer_ids, layer_id_convention=verifier.LAYER_ID_CONVENTION, storage_dtype=args.storage_dtype,
        fp8_scale_max=scale_max,
        # one dtype, or "mixed" when runs computing in both wrote this folder (compute_dtypes lists them)
        compute_dtype=dtypes[0] if len(dtypes) == 1 else "mixed" if dtypes else None, compute_dtypes=dtypes,
        compute_dtype_reason=plan.compute.reason if stats["tokens"] else None, prepared_data=os.path.abspath(plan.jsonl),
        counts={"rows": len(rows), "ok": ok, "failed": len(failed), "resumed": stats["resumed"],
                "extracted": ok - stats["resumed"], "tokens_extracted": tokens, "bytes": bytes_written,
                "shards": stats.get("shards", 1)},
        throughput={"seconds": round(secs, 2), "tokens_per_s": round(tokens / secs, 1) if secs else None},
        failures={str(i): r for i, r in sorted(failed.items())}, complete=not failed))
    log.info(f"done: {ok} ok, {len(failed)} failed, {stats['resumed']} resumed; {tokens:,} tokens in {secs:.0f} s "
             f"({tokens / max(secs, 1e-9):,.0f} tok/s); {bytes_written / 1e9:.2f} GB in {out}")
    if failed:
        log.error(f"{len(failed)} samples failed (reasons in {out}/manifest.json); "
                  + ("stage 04 trains on the others" if ok else "none is left to train on"))
    return 1 if failed else 0


@contextlib.contextmanager
def opened(args, plan, out):
    """Stage 02's verifier, loaded as the backend `args.backend` chooses (`args`: settings.Extract; `plan`:
    preflight.Plan), for the `with` block. vLLM writes through its connector into a spool this process makes,
    `<out>/.incoming/<pid>`; once the block ends normally, what the engine left there goes, and the spool with it."""
    t_load, staging, kind = time.time(), None, engines.kind(args.backend)
    if kind.spool:
        staging = outdir.make_dir(os.path.join(outdir.make_dir(os.path.join(out, INCOMING)), str(os.getpid())))
    backend = kind.start(args, plan.layer_ids, staging, plan.on_gpu, plan.compute.dtype,
                         os.path.join(out, engine_log(args.shard)))
    log.info(f"verifier loaded in {time.time() - t_load:.0f} s ({args.backend} backend, {plan.compute.dtype})")
    yield backend
    if staging:
        clear_spool(staging)
        outdir.remove(staging)
        outdir.remove(os.path.dirname(staging))  # .incoming, unless another replica's engine still uses it
