"""Stage 01 --regenerate: the verifier rewrites every assistant turn, so the draft trains on the verifier's own
answers (on-policy data, as in the EAGLE-3 paper). User and system turns are kept.

Turn by turn: round k asks the verifier, through vLLM, for the k-th assistant turn of every conversation, given
the conversation up to it with the turns already regenerated. A conversation whose prompt reaches --max-seq-len
is cut there (the rest would be truncated anyway). Assistant turns that open a conversation, before any user or
system turn, answer nothing and are dropped (counted in the manifest). Answers are appended to
`<output-dir>/.regenerating.jsonl` after every chunk of --regen-batch-size prompts: a killed run keeps them
and a rerun with the same settings asks only for the rest (the last finished run's `regenerated.jsonl` counts
too). On success stage 01 writes this run's answers to `regenerated.jsonl` and drops the working file.
"""
import hashlib
import json
import logging
import os

from ..base import compute, devices, faults
from ..base.errors import UsageError
from ..chat import masks
from ..engines import engine
from ..measures.draft_check import check_tp, split_heads
from ..storage import outdir
from ..verifier.verifier_weights import say

log = logging.getLogger("eagle3")
ENGINE_LOG = "engine.log"  # in stage 01's output folder: what the vLLM engine prints
GiB = 2**30


def batched_tokens(gpus, tp):
    """The max_num_batched_tokens vLLM will pick for make_llm's engine (an LLM, no value of ours): its own defaults
    by device (EngineArgs.get_batch_defaults), which our max_num_seqs (--regen-batch-size) must not exceed, or the
    engine refuses only after starting."""
    if not gpus:
        return 4096 * tp
    name, total = gpus[0]
    return 16384 if total >= 70 * GiB and "a100" not in name.lower() else 8192


def check(args, text_cfg):
    """--regenerate's flags against the device, the verifier and --max-seq-len, before the output folder is taken
    (vLLM refuses each of them 7 s or, on Kimi, many minutes later)."""
    gpus = devices.visible_gpus()
    bad = split_heads(args.regen_tp_size, text_cfg)
    if bad:
        raise UsageError(f"--regen-tp-size {args.regen_tp_size}: must divide the verifier's {bad[0]} ({bad[1]})")
    check_tp(args.regen_tp_size, gpus, "--regen-tp-size")
    most = batched_tokens(gpus, args.regen_tp_size)
    if args.regen_batch_size > most:
        raise UsageError(f"--regen-batch-size {args.regen_batch_size}: vLLM batches at most {most} tokens per step "
                         f"here (its max_num_batched_tokens on {'CPU' if not gpus else gpus[0][0]}), and each "
                         f"prompt in flight needs one; use at most {most}")
    # an answer follows a prompt of at least one token and leaves the position stage 02 reads past the row
    room = args.max_seq_len - 2
    if args.regen_max_tokens > room:
        raise UsageError(f"--regen-max-tokens {args.regen_max_tokens}: with --max-seq-len {args.max_seq_len} an "
                         f"answer has at most {max(room, 0)} tokens (the verifier's positions bound --max-seq-len); "
                         f"lower --regen-max-tokens or raise --max-seq-len")


def cache_path(out):
    return os.path.join(out, ".regenerating.jsonl")


def settings_of(args):
    return {"model": os.path.abspath(args.model_path) if os.path.isdir(args.model_path) else args.model_path,
            "temperature": args.regen_temperature, "max_tokens": args.regen_max_tokens, "seed": args.seed,
            "max_seq_len": args.max_seq_len}


def prompt_digest(messages):
    """What an answer answered: the conversation before it. Part of the cache's key beside the record's id and the
    turn, so that two records sharing an id, or a record edited between runs, never take each other's answers."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]


def load_cache(paths, settings):
    """{(record id, turn, prompt digest): text} of earlier runs with the same settings; a line cut by a kill is
    ignored, and so is one of a version that did not record its prompt."""
    done = {}
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                    if r.get("settings") == settings:
                        done[(r["id"], r["turn"], r["prompt"])] = r["text"]
                except (ValueError, AttributeError, KeyError, TypeError, RecursionError):
                    continue
    return done


def run(records, tok, args, out):
    """[(id, messages, tools)] -> (the same with assistant turns regenerated, counts, this run's answers as
    [{"id", "turn", "text", "settings"}]). Resumable (see above); `out` is stage 01's claimed output folder."""
    say(args.model_path, args.trust_remote_code)  # checked before the folder was taken (preparation.tokenizer)
    settings, path = settings_of(args), cache_path(out)
    done = load_cache([os.path.join(out, "regenerated.jsonl"), path], settings)
    answers = []
    convs, lead = [], 0
    for _, msgs, _ in records:  # no record here uses tools (read_conversations refuses them)
        # an assistant turn that opens the conversation answers nothing: the verifier would never say it
        k = next((m for m, x in enumerate(msgs) if x["role"] != "assistant"), len(msgs))
        lead += k
        # the verifier writes its own reasoning into the answers it regenerates: the data's would sit beside it
        convs.append([{key: v for key, v in m.items() if key != "reasoning_content"} for m in msgs[k:]])
    ids = [r[0] for r in records]
    cut = {}  # conversation -> index of the first message dropped (its prompt reached --max-seq-len)
    counts = {"turns_regenerated": 0, "turns_from_cache": 0, "conversations_cut": 0, "opening_turns_dropped": lead}
    llm, turn = None, 0
    on_gpu = bool(devices.visible_gpus())
    dtype = compute.resolve(args.dtype, on_gpu)
    counts["compute_dtype"] = dtype.dtype
    log.info(dtype.describe())
    if dtype.warning:
        log.warning(dtype.warning)
    while True:
        todo, active = [], False  # (conversation, message index, prompt ids) of each turn-th assistant message
        for j, msgs in enumerate(convs):
            pos = [m for m, x in enumerate(msgs) if x["role"] == "assistant" and m < cut.get(j, len(msgs))]
            if turn >= len(pos):
                continue
            active, m = True, pos[turn]
            key = (ids[j], turn, prompt_digest(msgs[:m]))
            if key in done:
                msgs[m]["content"] = done[key]
                answers.append({"id": ids[j], "turn": turn, "prompt": key[2], "text": msgs[m]["content"],
                                "settings": settings})
                counts["turns_from_cache"] += 1
                continue
            prompt = list(masks.prompt_ids(tok, msgs[:m]))
            if len(prompt) >= args.max_seq_len - 1:
                cut[j] = m
                continue
            todo.append((j, m, prompt, key[2]))
        if not active:
            break
        if todo:
            llm = llm or engine.make_llm(args.model_path, tp=args.regen_tp_size, max_model_len=args.max_seq_len,
                                         on_gpu=on_gpu, trust_remote_code=args.trust_remote_code, seed=args.seed,
                                         max_num_seqs=args.regen_batch_size, dtype=dtype.dtype,
                                         log_path=os.path.join(out, ENGINE_LOG))
            from vllm import SamplingParams  # after make_llm: importing vLLM prints, and the engine's log takes it
            log.info(f"regenerating assistant turn {turn + 1} of {len(todo)} conversations")
            for start in range(0, len(todo), args.regen_batch_size):
                chunk = todo[start:start + args.regen_batch_size]
                # a seed per conversation and turn makes a sampled answer independent of its batch, but vLLM
                # rewinds that generator after a chunked prefill, which CPU generators cannot do (the engine dies:
                # "CPU Generator does not use offset"); on CPU the engine's seed alone drives the sampling
                params = [SamplingParams(temperature=args.regen_temperature,
                                         seed=args.seed + j * 1009 + turn if on_gpu else None,
                                         max_tokens=min(args.regen_max_tokens, args.max_seq_len - len(p) - 1))
                          for j, _, p, _ in chunk]
                outs = engine.generate(llm, [{"prompt_token_ids": p} for _, _, p, _ in chunk], params, use_tqdm=False)
                with os.fdopen(outdir.open_append(path), "a", encoding="utf-8") as f:
                    for (j, m, _, digest), o in zip(chunk, outs):
                        convs[j][m]["content"] = o.outputs[0].text
                        answers.append({"id": ids[j], "turn": turn, "prompt": digest, "text": o.outputs[0].text,
                                        "settings": settings})
                        f.write(json.dumps(answers[-1]) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                counts["turns_regenerated"] += len(chunk)
                faults.kill_point("regen")
        turn += 1
    for j, m in cut.items():
        del convs[j][m:]
    counts["conversations_cut"] = len(cut)
    kept = [(rid, msgs, None) for rid, msgs in zip(ids, convs) if any(x["role"] == "assistant" for x in msgs)]
    return kept, counts, answers
