"""Stage 01 --regenerate: the verifier rewrites every assistant turn, so the draft trains on the verifier's own
answers (on-policy data, as in the EAGLE-3 paper). User and system turns are kept.

Turn by turn: round k asks the verifier, through vLLM or transformers (`--regen-engine`, answer_engines.py), for
the k-th assistant turn of every conversation, given the conversation up to it with the turns already regenerated.
A conversation whose prompt reaches --max-seq-len is cut there (the rest would be truncated anyway). Assistant turns
that open a conversation, before any user or system turn, answer nothing and are dropped (counted in the manifest). Answers are appended to
`<output-dir>/.regenerating.jsonl` after every chunk of --regen-batch-size prompts: a killed run keeps them
and a rerun with the same settings asks only for the rest (the last finished run's `regenerated.jsonl` counts
too). On success stage 01 writes this run's answers to `regenerated.jsonl` and drops the working file.

`--regen-samples N` (at a temperature above 0) answers every conversation N times, each copy its own conversation
(the first keeps the record's id, the others `<id>#sample<n>`); a copy whose answers all equal an earlier copy's is
left out and counted (`duplicate_samples`), so the rows stay distinct.
"""
import hashlib
import json
import logging
import os

from ..base import compute, devices, faults
from ..base.errors import UsageError
from ..chat import heldout, masks
from ..measures.draft_check import check_tp, split_heads
from ..storage import outdir
from ..verifier import quantization
from . import answer_engines
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
    if args.regen_samples > 1 and args.regen_temperature <= 0:
        raise UsageError(f"--regen-samples {args.regen_samples}: at --regen-temperature {args.regen_temperature:g} "
                         f"every sample is the same greedy answer; give a temperature (0.8, say)")
    chosen = answer_engines.pick(args.regen_engine)
    if not chosen.tensor_parallel and args.regen_tp_size > 1:
        raise UsageError(f"--regen-tp-size {args.regen_tp_size}: --regen-engine {args.regen_engine} answers through "
                         f"transformers{' (vLLM is not installed)' if args.regen_engine == 'auto' else ''}, on one "
                         f"device; use --regen-engine vllm for tensor parallel")
    gpus = devices.visible_gpus()
    bad = split_heads(args.regen_tp_size, text_cfg)
    if bad:
        raise UsageError(f"--regen-tp-size {args.regen_tp_size}: must divide the verifier's {bad[0]} ({bad[1]})")
    check_tp(args.regen_tp_size, gpus, "--regen-tp-size")
    most = batched_tokens(gpus, args.regen_tp_size)
    if chosen.caps_batch and args.regen_batch_size > most:
        raise UsageError(f"--regen-batch-size {args.regen_batch_size}: vLLM batches at most {most} tokens per step "
                         f"here (its max_num_batched_tokens on {'CPU' if not gpus else gpus[0][0]}), and each "
                         f"prompt in flight needs one; use at most {most}")
    # an answer follows a prompt of at least one token and leaves the position stage 02 reads past the row
    room = args.max_seq_len - 2
    if args.regen_max_tokens > room:
        raise UsageError(f"--regen-max-tokens {args.regen_max_tokens}: with --max-seq-len {args.max_seq_len} an "
                         f"answer has at most {max(room, 0)} tokens (the verifier's positions bound --max-seq-len); "
                         f"lower --regen-max-tokens or raise --max-seq-len")


def check_engine(args):
    """What the chosen engine cannot run of this verifier here, before the folder is taken (a quantization whose
    package transformers lacks, fp8 on a CPU, a kernel vLLM has not here): one line, not a traceback at the load."""
    chosen = answer_engines.pick(args.regen_engine)
    quant = quantization.read(args.model_path)
    if quant is None:
        return
    on_gpu = bool(devices.visible_gpus())
    if chosen.keeps_quantized:
        ok, why = quantization.kernel_here(quant, on_gpu)
        if not ok:
            raise UsageError(f"--regen-engine {chosen.name}: the verifier is {quant.describe()}, and {why}; use "
                             f"--regen-engine hf (transformers) or a GPU machine")
        return
    dtype = compute.resolve(args.dtype, on_gpu).dtype
    why = quantization.transformers_refusal(quant, on_gpu, dtype)
    if why:
        raise UsageError(f"--regen-engine {chosen.name}, compute dtype {dtype}: {why}")


def cache_path(out):
    return os.path.join(out, ".regenerating.jsonl")


def settings_of(args):
    """What an answer depends on: a cached one is taken only under the same (the engine included: greedy answers of
    vLLM and transformers part where their arithmetic does, tests/slow/test_regenerate.py)."""
    return {"model": os.path.abspath(args.model_path) if os.path.isdir(args.model_path) else args.model_path,
            "temperature": args.regen_temperature, "max_tokens": args.regen_max_tokens, "seed": args.seed,
            "max_seq_len": args.max_seq_len, "engine": answer_engines.pick(args.regen_engine).name}


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
    if args.regen_samples > 1:  # each copy its own conversation; the first keeps the record's id
        records = [(rid if s == 0 else f"{rid}#sample{s}", msgs, tools)
                   for rid, msgs, tools in records for s in range(args.regen_samples)]
    for _, msgs, _ in records:  # no record here uses tools (read_conversations refuses them)
        # an assistant turn that opens the conversation answers nothing: the verifier would never say it
        k = next((m for m, x in enumerate(msgs) if x["role"] != "assistant"), len(msgs))
        lead += k
        # the verifier writes its own reasoning into the answers it regenerates: the data's would sit beside it
        convs.append([{key: v for key, v in m.items() if key != "reasoning_content"} for m in msgs[k:]])
    ids = [r[0] for r in records]
    cut = {}  # conversation -> index of the first message dropped (its prompt reached --max-seq-len)
    counts = {"turns_regenerated": 0, "turns_from_cache": 0, "conversations_cut": 0, "opening_turns_dropped": lead,
              "duplicate_samples": 0}
    answerer, turn = None, 0
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
            if answerer is None:
                chosen = answer_engines.pick(args.regen_engine)
                log.info(f"--regenerate through {chosen.name}")
                answerer = chosen(args, tok, on_gpu, dtype.dtype, os.path.join(out, ENGINE_LOG))
            log.info(f"regenerating assistant turn {turn + 1} of {len(todo)} conversations")
            if answerer.by_length:
                todo.sort(key=lambda t: -len(t[2]))
            for start in range(0, len(todo), args.regen_batch_size):
                chunk = todo[start:start + args.regen_batch_size]
                texts = answerer.answers([p for _, _, p, _ in chunk],
                                         [min(args.regen_max_tokens, args.max_seq_len - len(p) - 1)
                                          for _, _, p, _ in chunk],
                                         args.regen_temperature, [args.seed + j * 1009 + turn for j, _, _, _ in chunk])
                with os.fdopen(outdir.open_append(path), "a", encoding="utf-8") as f:
                    for (j, m, _, digest), text in zip(chunk, texts):
                        convs[j][m]["content"] = text
                        answers.append({"id": ids[j], "turn": turn, "prompt": digest, "text": text,
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
    kept, seen = [], set()
    for rid, msgs in zip(ids, convs):
        if not any(x["role"] == "assistant" for x in msgs):
            continue
        if args.regen_samples > 1:  # a sampled copy the same as an earlier one of its record would repeat a row
            key = (heldout.SAMPLE.sub("", rid), json.dumps(msgs, sort_keys=True))
            if key in seen:
                counts["duplicate_samples"] += 1
                continue
            seen.add(key)
        kept.append((rid, msgs, None))
    return kept, counts, answers
