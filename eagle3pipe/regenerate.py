"""Stage 01 --regenerate: the verifier rewrites every assistant turn, so the draft trains on the verifier's own
answers (on-policy data, as in the EAGLE-3 paper). User and system turns are kept.

Turn by turn: round k asks the verifier, through vLLM, for the k-th assistant turn of every conversation, given
the conversation up to it with the turns already regenerated. A conversation whose prompt reaches --max-seq-len
is cut there (the rest would be truncated anyway). Assistant turns that open a conversation, before any user or
system turn, answer nothing and are dropped (counted in the manifest). Answers are appended to
`<output-dir>.regenerating.jsonl` after every chunk of --regen-batch-size prompts: a killed run keeps them
and a rerun with the same settings asks only for the rest. On success the file lands in the output folder as
`regenerated.jsonl`.
"""
import json
import logging
import os

from . import faults
from .preflight import visible_gpus

log = logging.getLogger("eagle3")


def cache_path(output_dir):
    return os.path.abspath(output_dir).rstrip("/") + ".regenerating.jsonl"


def _settings(args):
    return {"model": os.path.abspath(args.model_path) if os.path.isdir(args.model_path) else args.model_path,
            "temperature": args.regen_temperature, "max_tokens": args.regen_max_tokens, "seed": args.seed,
            "max_seq_len": args.max_seq_len}


def load_cache(path, settings):
    """{(record id, turn): text} of earlier runs with the same settings; a line cut by a kill is ignored."""
    done = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if r.get("settings") == settings:
                    done[(r["id"], r["turn"])] = r["text"]
    return done


def _engine(args, on_gpu):
    from .backends import cpu_vllm_env
    if not on_gpu:
        cpu_vllm_env()
    from vllm import LLM
    return LLM(model=args.model_path, dtype="bfloat16", max_model_len=args.max_seq_len,
               tensor_parallel_size=args.regen_tp_size, enforce_eager=not on_gpu, seed=args.seed,
               trust_remote_code=args.trust_remote_code, max_num_seqs=args.regen_batch_size)


def run(records, tok, args):
    """[(id, messages)] -> (the same with assistant turns regenerated, counts). Resumable (see above)."""
    settings, path = _settings(args), cache_path(args.output_dir)
    done = load_cache(path, settings)
    convs, lead = [], 0
    for _, msgs in records:
        # an assistant turn that opens the conversation answers nothing: the verifier would never say it
        k = next((m for m, x in enumerate(msgs) if x["role"] != "assistant"), len(msgs))
        lead += k
        convs.append([dict(m) for m in msgs[k:]])
    ids = [rid for rid, _ in records]
    cut = {}  # conversation -> index of the first message dropped (its prompt reached --max-seq-len)
    counts = {"turns_regenerated": 0, "turns_from_cache": 0, "conversations_cut": 0, "opening_turns_dropped": lead}
    llm, turn = None, 0
    on_gpu = bool(visible_gpus())
    while True:
        todo, active = [], False  # (conversation, message index, prompt ids) of each turn-th assistant message
        for j, msgs in enumerate(convs):
            pos = [m for m, x in enumerate(msgs) if x["role"] == "assistant" and m < cut.get(j, len(msgs))]
            if turn >= len(pos):
                continue
            active, m = True, pos[turn]
            if (ids[j], turn) in done:
                msgs[m]["content"] = done[(ids[j], turn)]
                counts["turns_from_cache"] += 1
                continue
            prompt = tok.apply_chat_template(msgs[:m], add_generation_prompt=True, tokenize=True)
            prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
            if len(prompt) >= args.max_seq_len - 1:
                cut[j] = m
                continue
            todo.append((j, m, prompt))
        if not active:
            break
        if todo:
            from vllm import SamplingParams
            llm = llm or _engine(args, on_gpu)
            log.info(f"regenerating assistant turn {turn + 1} of {len(todo)} conversations")
            for start in range(0, len(todo), args.regen_batch_size):
                chunk = todo[start:start + args.regen_batch_size]
                # a seed per conversation and turn makes a sampled answer independent of its batch, but vLLM
                # rewinds that generator after a chunked prefill, which CPU generators cannot do (the engine dies:
                # "CPU Generator does not use offset"); on CPU the engine's seed alone drives the sampling
                params = [SamplingParams(temperature=args.regen_temperature,
                                         seed=args.seed + j * 1009 + turn if on_gpu else None,
                                         max_tokens=min(args.regen_max_tokens, args.max_seq_len - len(p) - 1))
                          for j, _, p in chunk]
                outs = llm.generate([{"prompt_token_ids": p} for _, _, p in chunk], params, use_tqdm=False)
                with open(path, "a", encoding="utf-8") as f:
                    for (j, m, _), o in zip(chunk, outs):
                        convs[j][m]["content"] = o.outputs[0].text
                        f.write(json.dumps({"id": ids[j], "turn": turn, "text": o.outputs[0].text,
                                            "settings": settings}) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                counts["turns_regenerated"] += len(chunk)
                faults.kill_point("regen")
        turn += 1
    for j, m in cut.items():
        del convs[j][m:]
    counts["conversations_cut"] = len(cut)
    return [(rid, msgs) for rid, msgs in zip(ids, convs) if any(x["role"] == "assistant" for x in msgs)], counts
