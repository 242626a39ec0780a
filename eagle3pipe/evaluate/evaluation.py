"""Stage 05: what the draft is worth, measured through vLLM.

Acceptance length = 1 + accepted draft tokens / drafting steps (the tokens a verifier step yields on average);
per-position rate i = drafts whose i-th token was accepted / drafts. Both come from vLLM's own spec-decode
counters, read before and after each run so every batch size gets its own figures.
"""
import json
import logging
import os
import time

from ..engines import engine
from ..measures.draft_check import check_draft, serving_mismatches  # noqa: F401 (the draft's checks; tests' names)
from ..adapters import close_engine
from ..base.errors import UsageError
from ..chat.heldout import train_manifest
from ..config.cli import describe
from ..drafts.mla_draft import served_path
from ..engines.engine import make_llm
from ..measures import acceptance
from ..measures.acceptance import expected_acceptance
from ..measures.draft_check import check_folder
from ..storage.files import open_input, read_json, read_manifest
from ..verifier.verifier import weights_bytes

log = logging.getLogger("eagle3")


def candidates(draft):
    """The checkpoints to measure: every epoch checkpoint of a stage 04 folder (numbered folders holding a
    config.json, in epoch order), or the one checkpoint `draft` names. -> [(name, path)]."""
    if os.path.isdir(draft) and not os.path.isfile(os.path.join(draft, "config.json")):
        man = read_manifest(draft)
        if not (isinstance(man, dict) and man.get("stage") == "train"):
            raise UsageError(f"--draft {draft}: neither a checkpoint (no config.json) nor a stage 04 folder (no "
                             f"stage 04 manifest.json); give data/checkpoints/last or data/checkpoints")
        found = sorted((int(n), n) for n in os.listdir(draft) if n.isdigit() and os.path.isfile(
            os.path.join(draft, n, "config.json")) and not os.path.islink(os.path.join(draft, n)))
        if not found:
            raise UsageError(f"--draft {draft}: a stage 04 folder without a finished checkpoint; rerun 04_train.py")
        return [(n, os.path.join(draft, n)) for _, n in found]
    return [(os.path.basename(os.path.realpath(draft)), draft)]


def run_names(drafts):
    """What each draft is called among the others: its stage 04 folder's name (a checkpoint's parent, or the folder
    given), with as many of the folders above it as tell it from another run's folder of the same name
    (runs/a/checkpoints and runs/b/checkpoints: a/checkpoints, b/checkpoints)."""
    def folder(draft):
        real = os.path.realpath(draft)
        return os.path.dirname(real) if os.path.isfile(os.path.join(real, "config.json")) else real
    folders = [folder(d) for d in drafts]
    depth = dict.fromkeys(folders, 1)
    while True:  # different real paths differ at some depth: this ends
        names = {f: "/".join(f.split(os.sep)[-depth[f]:]) for f in depth}
        clash = [f for f in depth if list(names.values()).count(names[f]) > 1]
        if not clash:
            return [names[f] for f in folders]
        for f in clash:
            depth[f] += 1


def drafts_to_measure(drafts, fp, text_cfg, tp=1, k=None):
    """Every checkpoint the `--draft` paths name (each one checkpoint, or each epoch of a stage 04 folder), checked
    before any engine loads: an eagle3 checkpoint for this verifier, every field of its config and its weights' headers
    (draft_check.py), and the run that trained it. With several paths each name is prefixed by its run's folder name
    ('<run>/<epoch>'). `tp`, `k`: --tp-size (the draft's heads are split too), --num-speculative-tokens.
    -> ([(name, path)], [warnings])."""
    found, warnings = [], []
    for draft, run in zip(drafts, run_names(drafts)):
        found += [(name if len(drafts) == 1 else f"{run}/{name}", path) for name, path in candidates(draft)]
    seen = {}
    for name, path in found:
        if os.path.realpath(path) in seen.values() or name in seen:
            raise UsageError(f"--draft {path}: named twice (as {name}); give each checkpoint once")
        seen[name] = os.path.realpath(path)
    for name, path in found:
        cfg = check_draft(path, fp)
        check_folder(path, cfg, text_cfg, tp)
        man = train_manifest(path)
        hard, soft = serving_mismatches(cfg, text_cfg, man)
        if hard:
            raise UsageError(f"--draft {path}: {hard[0]}; it would read other inputs than it was trained on: rerun "
                             f"04_train.py")
        warnings += [f"--draft {path}: {s} (the draft may accept less than it could)" for s in soft]
        steps = (man.get("args") or {}).get("ttt_steps")
        if k and isinstance(steps, int) and k > steps:
            warnings.append(f"--num-speculative-tokens {k}: {path} was trained for {steps} steps; positions past "
                            f"{steps} chain its own guesses further than training did and accept less")
    return found, warnings


def rank(found, run):
    """Each checkpoint measured on the same prompts (`run(path)` -> its figures by batch size), best first by the
    acceptance length at batch size 1. -> ([{"name", "draft", "acceptance_length", "per_position", "trainer",
    "tokens_per_s", "seconds_per_round"}], the best one's figures). At batch size 1 each proposal is one round
    (k draft steps and one verification), so the time a round takes is what a checkpoint costs, whatever it
    accepts: a deeper draft's cost beside its acceptance, from the same run."""
    rows, figures = [], {}
    for name, path in found:
        figures[name] = got = run(os.path.abspath(path))
        one = got[1]
        rows.append({"name": name, "draft": os.path.realpath(path), "acceptance_length": one["acceptance_length"],
                     "per_position": one["per_position"], "trainer": expected_acceptance(_val_metrics(path)),
                     "tokens_per_s": one["tokens_per_s"],
                     "seconds_per_round": round(one["seconds"] / one["drafts"], 5) if one["drafts"] else None})
    rows.sort(key=lambda r: -(r["acceptance_length"] or 0))
    return rows, figures[rows[0]["name"]]


def measure_without_vllm(args, drafts, prompt_ids, on_gpu, ranking):
    """eagle3pipe/measures/acceptance.py's measure for every draft on the same prompts, beside vLLM's figures; each ranking
    row gets its "measure". -> {"acceptance_length", "per_position", "vllm", "vllm_per_position", "drafts",
    "accepted", "by_draft", "reference_seconds"} for the best draft, or {"skipped": why}."""
    size = weights_bytes(args.model_path) if os.path.isdir(args.model_path) else None
    if args.measure == "off" or (args.measure == "auto" and not (size and size <= acceptance.MEASURE_MAX_WEIGHT_BYTES)):
        why = "--measure off" if args.measure == "off" else "the verifier's weights are over 10 GB (--measure on runs it)"
        log.info(f"acceptance without vLLM: skipped ({why})")
        return {"skipped": why}
    log.info("acceptance without vLLM: the verifier's greedy continuations in float32 through transformers, then one "
             "forward per draft")
    try:
        by_draft, ref_seconds = acceptance.measure_all(drafts, args.model_path, prompt_ids,
                                                       args.num_speculative_tokens, args.max_new_tokens,
                                                       "cuda" if on_gpu else "cpu", args.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - an addition to vLLM's figures must never cost them
        why = f"failed: {describe(e, advice=False)[1]}"
        log.warning(f"acceptance without vLLM: {why}")
        return {"skipped": why}
    for row in ranking:
        got = by_draft[row["name"]]
        row["measure"] = {k: got[k] for k in ("acceptance_length", "per_position", "drafts", "accepted")}
    best = ranking[0]
    got = by_draft[best["name"]]
    return {"acceptance_length": got["acceptance_length"], "per_position": got["per_position"],
            "vllm": best["acceptance_length"], "vllm_per_position": best["per_position"], "drafts": got["drafts"],
            "accepted": got["accepted"], "position_average": got["position_average"],
            "reference_seconds": ref_seconds, "by_draft": {n: {k: v for k, v in d.items() if k != "per_prompt"}
                                                           for n, d in by_draft.items()}}


def measure_alone(args, plan):
    """Where vLLM does not run: acceptance.py's measure of every draft on the same prompts, ranked as vLLM's figures
    are. -> run()'s tuple with no engine figures: ([], None, None, ranking, measure)."""
    log.info("acceptance without vLLM: the verifier's greedy continuations in float32 through transformers, then one "
             "forward per draft")
    by_draft, ref_seconds = acceptance.measure_all(plan.drafts, args.model_path, plan.ids, args.num_speculative_tokens,
                                                   args.max_new_tokens, "cuda" if plan.gpus else "cpu",
                                                   args.trust_remote_code)
    ranking = sorted(({"name": name, "draft": os.path.realpath(path), "trainer": expected_acceptance(_val_metrics(path)),
                       **{k: by_draft[name][k] for k in ("acceptance_length", "per_position", "drafts", "accepted",
                                                        "position_average", "seconds")}}
                      for name, path in plan.drafts), key=lambda r: -(r["acceptance_length"] or 0))
    return [], None, None, ranking, {"reference_seconds": ref_seconds}


def _val_metrics(path):
    p = os.path.join(path, "val_metrics.json")
    try:
        return read_json(p) if os.path.isfile(p) else None
    except UsageError:
        return None


MARGIN = 0.15  # acceptance length: the trainer's estimate and vLLM's measurement farther apart than this are named


def reconcile(draft, measured):
    """The trainer's estimate for a checkpoint (its val_metrics.json) beside vLLM's measurement (`measured`: one
    batch size's figures) -> {"trainer": ..., "vllm": ..., "per_position": [[trainer, vllm], ...], "note"}."""
    val = _val_metrics(draft)
    est, got = expected_acceptance(val), measured.get("acceptance_length")
    if est is None or got is None:
        return {"trainer": est, "vllm": got, "note": "no trainer estimate for this checkpoint" if est is None else None}
    trainer_pos = [val[f"full_acc_{k}_epoch"] for k in range(len(measured.get("per_position", [])))
                   if f"full_acc_{k}_epoch" in val]
    note = None
    if abs(est - got) > MARGIN:
        note = (f"the trainer's estimate ({est:.2f}) and vLLM's measurement ({got:.2f}) differ by more than {MARGIN}: "
                + ("the held-out prompts are harder than the validation rows (other topics, or answers longer than "
                   "training saw), or the draft overfits the training data" if est > got else
                   "the validation rows are harder than these prompts (short, formulaic answers accept more)")
                + "; a config mismatch (above) would also show here")
    return {"trainer": round(est, 4), "vllm": got,
            "per_position": [[round(t, 4), v] for t, v in zip(trainer_pos, measured.get("per_position", []))],
            "note": note}


def read_train_metrics(draft):
    """Stage 04's logs/metrics.jsonl beside a stage 04 checkpoint (for the plot), or []; lines that are not JSON
    objects (a log cut short) are skipped, and counted in the warning. -> (records, warning or None)."""
    path = os.path.join(os.path.dirname(os.path.realpath(draft)), "logs", "metrics.jsonl")
    if not os.path.isfile(path):
        return [], None
    records, bad = [], 0
    with open_input(path, "rb") as f:
        for line in f:
            try:
                r = json.loads(line)
            except (ValueError, RecursionError):
                r = None
            if isinstance(r, dict):
                records.append(r)
            else:
                bad += 1
    return records, (f"{path}: {bad} lines are not JSON records (a log cut short?); the plot leaves them out"
                     if bad else None)


def spec_counters(llm):
    """vLLM's cumulative spec-decode counters (absent without a draft)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for m in llm.get_metrics():
        name = m.name
        if name == "vllm:spec_decode_num_drafts":
            out["drafts"] = m.value
        elif name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] = m.value
        elif name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] = m.value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = list(m.values)
    return out


NEAR_TIE = 0.5  # nats between the verifier's top two tokens: bf16 rounding in another batch shape can flip them


def divergences(llm, prompt_ids, reference, outputs):
    """For each prompt whose greedy output differs from the reference (the run without the draft): the first differing
    position and the verifier's own margin there (top-1 minus top-2 log-probability, from one greedy step on the prompt
    plus the common prefix). A small margin means a near-tie that bf16 numerics decide, not a draft's error: vLLM's
    verification recomputes those positions k+1 at a time, in another shape than plain decoding."""
    from vllm import SamplingParams
    found = []
    for i, (a, b) in enumerate(zip(reference, outputs)):
        if a == b:
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if pos >= min(len(a), len(b)):  # one output is a prefix of the other: they differ only in where they stop
            found.append({"prompt": i, "position": pos, "margin": None, "reason": "length only"})
            continue
        o = engine.generate(llm, [{"prompt_token_ids": list(prompt_ids[i]) + a[:pos]}],
                         SamplingParams(max_tokens=1, temperature=0.0, logprobs=2), use_tqdm=False)[0].outputs[0]
        top = sorted(o.logprobs[0].items(), key=lambda kv: -kv[1].logprob)[:2]
        margin = top[0][1].logprob - top[1][1].logprob if len(top) > 1 else None
        found.append({"prompt": i, "position": pos, "without_draft": a[pos], "with_draft": b[pos],
                      "verifier_top2": [t for t, _ in top], "margin": None if margin is None else round(margin, 4)})
    return found


def explain(diffs, n):
    """The greedy-equality line: how many agree, and for those that do not, whether the verifier itself was tied."""
    line = f"greedy outputs identical at batch size 1: {n - len(diffs)}/{n}"
    if not diffs:
        return line
    ties = [d for d in diffs if d["margin"] is not None and d["margin"] < NEAR_TIE and
            d["with_draft"] in d["verifier_top2"]]
    lengths = [d for d in diffs if d["margin"] is None]
    rest = [d for d in diffs if d not in ties and d not in lengths]
    parts = []
    if ties:
        parts.append(f"{len(ties)} diverge where the verifier's top two tokens are within "
                     f"{max(d['margin'] for d in ties):.2f} nats (bf16 numerics, not the draft)")
    if lengths:
        parts.append(f"{len(lengths)} differ only in length")
    if rest:
        d = rest[0]
        parts.append(f"{len(rest)} diverge at a clear choice of the verifier (prompt {d['prompt']}, token {d['position']}:"
                     f" margin {d['margin']} nats): worth a look")
    return line + "; " + "; ".join(parts)


def run_engine(model_path, prompt_ids, batch_sizes, max_new_tokens, *, dtype, log_path, draft=None, k=3,
               max_model_len=4096, on_gpu=False, tp=1, trust_remote_code=False, reference=None,
               gpu_memory_utilization=0.9):
    """Greedy generation at each batch size (prompts submitted b at a time) -> {b: figures}. With `reference` (the
    batch-1 outputs without the draft), results[1]["divergences"] explains each output that differs. `dtype`: the
    compute dtype of verifier and draft (compute.py); `log_path`: the engine's output."""
    kw = {"gpu_memory_utilization": gpu_memory_utilization} if on_gpu else {}  # vLLM's CPU sizes its cache apart
    if draft:
        kw["speculative_config"] = {"method": "eagle3", "model": served_path(draft), "num_speculative_tokens": k}
    llm = make_llm(model_path, tp=tp, max_model_len=max_model_len, on_gpu=on_gpu, trust_remote_code=trust_remote_code,
                   dtype=dtype, log_path=log_path, enable_prefix_caching=False, disable_log_stats=False, max_num_seqs=max(batch_sizes),
                   **kw)
    from vllm import SamplingParams  # after make_llm: importing vLLM prints, and the engine's log takes it
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=False)
    try:
        return _generate_all(llm, prompt_ids, batch_sizes, params, draft, reference)
    finally:  # the next engine starts on a machine this one has left
        close_engine(llm)


def _generate_all(llm, prompt_ids, batch_sizes, params, draft, reference):
    """run_engine's generation on a started engine -> {b: figures}."""
    results = {}
    for b in batch_sizes:
        before = spec_counters(llm)
        outs, t0 = [], time.time()
        for i in range(0, len(prompt_ids), b):
            chunk = [{"prompt_token_ids": p} for p in prompt_ids[i:i + b]]
            outs += [list(o.outputs[0].token_ids) for o in engine.generate(llm, chunk, params, use_tqdm=False)]
        secs = time.time() - t0
        after = spec_counters(llm)
        drafts = after["drafts"] - before["drafts"]
        accepted = after["accepted"] - before["accepted"]
        per_pos = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0)
                   for i, a in enumerate(after["per_pos"])]
        n_tok = sum(len(o) for o in outs)
        results[b] = {"outputs": outs, "seconds": round(secs, 2), "output_tokens": n_tok,
                      "tokens_per_s": round(n_tok / secs, 2) if secs else None}
        if draft:
            results[b].update(
                drafts=drafts, accepted=accepted, draft_tokens=after["draft_tokens"] - before["draft_tokens"],
                acceptance_length=round(1 + accepted / drafts, 4) if drafts else None,
                per_position=[round(x / drafts, 4) for x in per_pos] if drafts else [],
                draft_token_acceptance=round(accepted / max(after["draft_tokens"] - before["draft_tokens"], 1), 4))
    if reference is not None:  # after the timed runs: these extra steps must not count in tok/s or acceptance
        results[1]["divergences"] = divergences(llm, prompt_ids, reference, results[1]["outputs"])
    return results


def run(args, plan, log_path):
    """The baseline engine, then each draft's on the same prompts, then the measure without vLLM.
    -> (sizes, baseline figures by batch size, the best draft's figures by batch size, ranking, measure)."""
    if plan.without_vllm:
        return measure_alone(args, plan)
    sizes = sorted(set([1] + args.batch_sizes))
    common = dict(max_model_len=plan.max_model_len, on_gpu=bool(plan.gpus), tp=args.tp_size,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  trust_remote_code=args.trust_remote_code, dtype=plan.dtype.dtype, log_path=log_path)
    base = run_engine(args.model_path, plan.ids, sizes, args.max_new_tokens, **common)

    def spec_run(path):
        return run_engine(args.model_path, plan.ids, sizes, args.max_new_tokens, draft=path,
                          k=args.num_speculative_tokens, reference=base[1]["outputs"], **common)
    ranking, spec = rank(plan.drafts, spec_run)  # each checkpoint on the same prompts, the best first
    measured = measure_without_vllm(args, plan.drafts, plan.ids, bool(plan.gpus), ranking)
    return sizes, base, spec, ranking, measured
