"""Stage 05's plan: every check on the verifier, the drafts, the prompts and the flags, resolved once into a frozen
record before anything heavy loads or the output folder is taken (a mistake costs seconds, not a verifier's load)."""
import dataclasses
import functools
import logging
import os
from typing import Optional

from . import evaluation
from ..base import compute, devices
from ..chat import conversations, heldout, masks, tokenize_workers
from ..config import cli
from ..drafts.mla_draft import is_mla_checkpoint
from ..engines import engine
from ..measures import draft_check
from ..storage import files, outdir
from ..verifier import quantization, verifier, vllm_support
from ..verifier.verifier_weights import say, verify

log = logging.getLogger("eagle3")


@dataclasses.dataclass(frozen=True)
class Plan:
    fp: dict                # the verifier's fingerprint (verifier.open_verifier)
    drafts: list            # [(name, checkpoint path)], every one checked
    mismatches: list        # warnings: a draft's config against the verifier's
    inputs: list            # [(flag, path)] the output folder must not overlap
    skip: int               # records of --prompts stage 01 read: never measured on
    prompts: list           # the chats measured on
    ids: list               # each prompt's token ids through the chat template
    max_model_len: int
    dtype: compute.Compute
    gpus: list
    train_metrics: list     # stage 04's metrics.jsonl of the first draft (the plot)
    warnings: list          # said once the folder is taken (all of them, in the dry run)
    without_vllm: Optional[str] = None  # why vLLM does not run (the measure alone is reported), or None: it does


def vllm_absent_reason(fp, tc, gpus, drafts, dtype):
    """Why vLLM cannot measure these drafts here (not installed; no EAGLE-3 for the family; an engine that would die
    at start on this machine), or None: it can. Found from files and flags, before anything loads. Without `drafts`,
    what the verifier alone tells."""
    if not vllm_support.installed():
        return "vLLM is not installed here"
    unserved = vllm_support.eagle3_refusal(fp.get("architecture"))
    if unserved or drafts is None:  # the baseline engine would run first, then the speculative one die as it started
        return unserved
    blocker = engine.eagle3_blocker(tc, bool(gpus), mla_draft=all(is_mla_checkpoint(p) for _, p in drafts),
                                    dtype=dtype.dtype)
    return f"cannot evaluate an eagle3 draft here: {blocker}" if blocker else None


def engine_choice(args, why):
    """--vllm against what this machine can run -> the reason the measure stands alone, or None (vLLM measures).
    Refused: --vllm on where vLLM cannot run, and no measure at all."""
    if args.vllm == "on" and why:
        raise cli.UsageError(f"--model-path {args.model_path}: {why}; --vllm on: run stage 05 where vLLM serves the "
                             f"draft, or without --vllm on for the acceptance measure alone")
    alone = "--vllm off" if args.vllm == "off" else why
    if alone and args.measure == "off":
        raise cli.UsageError(f"--measure off: without vLLM ({alone}) stage 05 would measure nothing; drop "
                             f"--measure off")
    return alone


def plan(args):
    """-> Plan. Raises cli.UsageError naming the flag, file or record at the first problem."""
    fp, tc = verifier.open_verifier(args.model_path, args.trust_remote_code)
    if args.vllm == "on":  # what the verifier alone tells, before the drafts are read
        engine_choice(args, vllm_absent_reason(fp, tc, None, None, None))
    verifier.check_chat_files(args.model_path)
    gpus = devices.visible_gpus()
    draft_check.check_run(args, fp, tc, gpus)  # the flags against the verifier's positions and the GPUs
    conversations.check_dataset(args.prompts, "--prompts")
    drafts, mismatches = evaluation.drafts_to_measure(args.draft, fp, tc, args.tp_size, args.num_speculative_tokens)
    dtype = compute.resolve(args.dtype, bool(gpus))
    # in seconds, not after the verifier's load
    without_vllm = engine_choice(args, vllm_absent_reason(fp, tc, gpus, drafts, dtype))
    why = quantization.transformers_refusal(quantization.read(args.model_path), bool(gpus), dtype.dtype)
    if why and (without_vllm or args.measure != "off"):  # the measure runs the verifier in transformers
        raise cli.UsageError(f"--model-path {args.model_path}: the acceptance measure, compute dtype {dtype.dtype}: {why}")
    inputs = [("--model-path", args.model_path), ("--prompts", args.prompts), ("--prepared-data", args.prepared_data)]
    for d in args.draft:  # nothing goes inside a draft's stage 04 folder
        run = os.path.dirname(os.path.realpath(d)) if os.path.isfile(os.path.join(d, "config.json")) else d
        inputs.append(("--draft", run if os.path.lexists(os.path.join(run, files.MANIFEST)) else d))
    outdir.check("--output-dir", args.output_dir, "evaluate", inputs)
    skip, unknown = heldout.held_out_skip(args.prompts, args.prepared_data, drafts)  # never on training data
    train_metrics, cut = evaluation.read_train_metrics(drafts[0][1])
    wheres, seen, tools = [], {}, []
    prepared = args.prepared_data if os.path.isdir(args.prepared_data) else heldout.recorded_prepared(drafts)
    prompts = heldout.select_prompts(args, skip, wheres, heldout.trained_ids(prepared), seen, tools)
    # the checks that need transformers, after every cheap one and before the folder is taken: the verifier's weights
    # against the model its config defines, then the prompts' tokens
    verify(args.model_path, args.trust_remote_code)  # said once the folder is taken (announce, dry_run)
    tok = masks.load_tokenizer(args.model_path, args.trust_remote_code)
    maxpos, ids = fp.get("max_position_embeddings"), []
    at_most = maxpos if isinstance(maxpos, int) and maxpos > 0 else None
    # each render within the template's time budget, in a worker process this stage kills if one C call outlasts it
    work = functools.partial(masks.prompt_outcome, tok, at_most)
    slow = lambda i, seconds: cli.UsageError(f"--prompts {wheres[i]}: {masks.too_slow(tok, seconds)}")  # noqa: E731
    for i, (kind, *got) in enumerate(tokenize_workers.mapped(list(zip(prompts, tools)), work,
                                                             tokenize_workers.count(None, len(prompts)), slow)):
        if kind == "long":  # refused by its length alone, before minutes of tokenizing
            raise cli.UsageError(f"--prompts {wheres[i]}: a prompt of {got[0]}; the verifier's {maxpos} positions "
                                 f"leave no room for an answer: give prompts without it")
        if kind in ("slow", "panic"):
            raise cli.UsageError(f"--prompts {wheres[i]}: {got[0]}")
        ids.append(got[0])
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    max_len = draft_check.max_model_len(len(ids[longest]), args, maxpos, wheres[longest])
    fewer = (f"--num-prompts {args.num_prompts}: {args.prompts} holds {len(prompts)} usable prompts after the first "
             f"{skip} records; evaluating those") if len(prompts) < args.num_prompts else None
    copied = (f"--prompts {args.prompts}: {seen['trained']} records carry the ids of records stage 01 trained on (a "
              f"copy of its data?); skipped") if seen.get("trained") else None
    return Plan(fp=fp, drafts=drafts, mismatches=mismatches, inputs=inputs, skip=skip, prompts=prompts, ids=ids,
                max_model_len=max_len, dtype=dtype, gpus=gpus, train_metrics=train_metrics,
                warnings=[w for w in [unknown, cut, fewer, copied, alone_warning(without_vllm)] + mismatches if w],
                without_vllm=without_vllm)


def alone_warning(why):
    if why:
        return (f"no vLLM run ({why}): the acceptance measure alone is reported (eagle3pipe/measures/acceptance.py: the "
                f"verifier's greedy continuations through transformers, then one forward per draft; its figure equals "
                f"vLLM's); speed-up needs vLLM")
    return None


def dry_run(args, p):
    """What the run would do, every warning included; nothing loaded or written."""
    say(args.model_path, args.trust_remote_code)
    for warning in p.warnings:
        log.warning(warning)
    print(f"dry run: {len(p.drafts)} checkpoint(s) checked ({', '.join(n for n, _ in p.drafts)}); {len(p.prompts)} "
          f"prompts (after the first {p.skip} records, which stage 01 read) of at most "
          f"{max(len(i) for i in p.ids)} tokens, max_model_len {p.max_model_len}; {p.dtype.describe()}; "
          f"{f'{len(p.gpus)} GPU(s), --tp-size {args.tp_size}' if p.gpus else 'CPU'}; nothing loaded, nothing written")


def announce(args, p):
    """The run's first lines, once the folder is taken."""
    say(args.model_path, args.trust_remote_code)
    log.info(p.dtype.describe())
    for warning in [p.dtype.warning] + p.warnings:
        if warning:
            log.warning(warning)
    log.info(f"{len(p.prompts)} prompts from {args.prompts} (after the first {p.skip} records)")
