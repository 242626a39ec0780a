"""Stage 04's `checkpoint_best` by the acceptance length vLLM would measure (acceptance.py), not by the trainer's
estimate. The trainer's estimate averages per-position accuracy over every index of teacher-forced validation rows
(ShareGPT's answers, late positions of long conversations included); vLLM counts rounds on the verifier's own greedy
answers to first-turn prompts, each round starting where the last one stopped. The two rank drafts differently
(docs/RECIPE.md, "Acceptance without vLLM"), so the epoch that serves best is chosen by the measure:
- prompts: the first turn of stage 04's validation rows (never trained on): every token before the row's first
  trained token, which ends with the chat template's generation prompt;
- references: the verifier's greedy continuation of each (transformers, float32, on the training device), made once
  per run, then freed;
- at each validation: one TTT forward of the draft being trained per prompt, counted as vLLM counts.
The trainer's estimate stays in the log and in each checkpoint's val_metrics.json beside the measure.
"""
import logging
import os
import time
from ..measures import acceptance
from ..measures.acceptance import MEASURE_MAX_WEIGHT_BYTES
from ..verifier.verifier import weights_bytes

log = logging.getLogger("eagle3pipe")

MAX_PROMPT_TOKENS = 1024  # a prompt longer than this says little about the first answer tokens and costs time


def validation_prompts(rows, val_ratio, n):
    """Up to `n` distinct prompts from the validation rows (speculators' split: the rows from int(rows x (1 -
    val_ratio)) on): the ids before each row's first trained token."""
    out, seen = [], set()
    for ids, mask in rows[int(len(rows) * (1 - val_ratio)):]:
        first = next((i for i, m in enumerate(mask if mask is not None else ()) if m), None)
        if not first or first > MAX_PROMPT_TOKENS:
            continue
        prompt = [int(x) for x in ids[:first]]  # Python ints: the prompts go to JSON and torch
        if tuple(prompt) not in seen:
            seen.add(tuple(prompt))
            out.append(prompt)
        if len(out) >= n:
            break
    return out


def plan(args, rows, aux_layer_ids, on_cpu):
    """-> a Measure, or None with one log line saying why `checkpoint_best` falls back to the trainer's estimate."""
    why = None
    if args.measure_prompts == 0:
        why = "--measure-prompts 0"
    elif args.fsdp:
        why = "FSDP shards the draft over the ranks; one rank alone cannot run it"
    else:
        size = weights_bytes(args.model_path) if os.path.isdir(args.model_path) else None
        if not size or size > MEASURE_MAX_WEIGHT_BYTES:
            why = ("the verifier's weights are over 10 GB: its continuations come from stage 05's measure, not from "
                   "a second copy beside training") if size else "the verifier is not a local folder"
    prompts = [] if why else validation_prompts(rows, args.val_ratio, args.measure_prompts)
    if not why and not prompts:
        why = "no validation row has a first turn to continue"
    if why:
        log.info(f"checkpoint_best: by the trainer's estimate ({why})")
        return None
    return Measure(args.model_path, aux_layer_ids, prompts, args.ttt_steps, args.measure_tokens,
                   "cpu" if on_cpu else "cuda", args.trust_remote_code)


class Measure:
    """The references, made at the first validation; `score(model)` at every one."""

    def __init__(self, model_path, layer_ids, prompts, k, max_new_tokens, device, trust_remote_code=False):
        self.model_path, self.layer_ids, self.prompts = model_path, list(layer_ids), prompts
        self.k, self.max_new_tokens, self.device, self.trust_remote_code = k, max_new_tokens, device, trust_remote_code
        self.refs = self.stops = None
        self.failed = None  # why the measure failed once (checkpoints.update_best then follows the estimate)

    def describe(self):
        return f"{len(self.prompts)} held-out prompts, {self.max_new_tokens} tokens, k={self.k}"

    def _references(self):
        t0 = time.time()
        self.refs = acceptance.references(self.model_path, self.prompts, self.k, self.max_new_tokens, self.layer_ids,
                                          "float32", self.device, self.trust_remote_code)
        self.stops = acceptance.stop_ids(self.model_path, self.trust_remote_code)
        log.info(f"acceptance measure: the verifier's greedy continuations of {len(self.prompts)} validation "
                 f"prompts in {time.time() - t0:.1f} s (once per run)")

    def score(self, model):
        """-> {"acceptance_length", "per_position", "prompts", "k", "max_new_tokens", "seconds"} for the draft in
        training (unwrapped from DDP/compile; eval mode for the forward, then back)."""
        import torch
        if self.refs is None:
            self._references()
        m = model
        for attr in ("module", "_orig_mod"):
            m = getattr(m, attr, m)
        was, t0 = m.training, time.time()
        m.eval()
        try:
            with torch.no_grad():
                got = acceptance.score(m, self.refs, self.k, self.max_new_tokens, self.stops)
        finally:
            m.train(was)
        return {"acceptance_length": got["acceptance_length"], "per_position": got["per_position"],
                "prompts": len(self.refs), "k": self.k, "max_new_tokens": self.max_new_tokens,
                "seconds": round(time.time() - t0, 2)}
