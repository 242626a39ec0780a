"""How long stages 02-05 will take on this machine, from a short measurement: what `scripts/quickstart.sh` prints
before it commits to the run, and how it sizes the run to fit a time budget.

The measurement: one forward of the verifier (transformers, the compute dtype compute.py picks) over a real prepared
row of up to 1,024 tokens, timed after a warm-up pass (about 10 s in all). The stages' own rates are that forward rate
times ratios measured on this project's reference machine in the same dtype (REFERENCE below: bench/bench_dtype_cpu.py,
docs/BENCHMARKS.md): matmul-bound work scales with the forward rate, so a machine whose forward is 3x slower runs the
stages about 3x slower; fixed costs (engine start-up) scale the same way. It is an estimate, about right, not a
promise: each stage prints its own estimate from its first batches once it runs.

    python -m eagle3pipe.evaluate.estimate --model-path M --prepared-data data/prepared --samples 300 --epochs 1 \
        [--budget-min 24]     # stdout: the number of conversations that fits (stderr: the estimate)
"""
import argparse
import dataclasses
import json
import math
import os
import sys
import time

from ..base import compute
from ..base.compute import CHOICES
from ..base.devices import visible_gpus
from ..base.errors import UsageError
from ..config import cli
from ..verifier.verifier_weights import check_loaded

# Calibrated on this project's 2-core AMD EPYC (AVX-512 with avx512_bf16, no AMX) running the quickstart itself
# (284 rows, 387,942 tokens; docs/BENCHMARKS.md): bf16 natively; float32 with torch held to AVX2 kernels, the setting
# in which auto picks float32. Per compute dtype: measure()'s forward tok/s; each stage's rate per prepared token as a
# multiple of it (02: vLLM backend; 04: 2,048-token packed steps, one epoch); 05: generated tok/s of either engine;
# fixed costs in seconds at that forward rate (engine start-up, imports, validation, checkpoints).
REFERENCE = {
    "bfloat16": {"fwd": 1443.0, "02": 1.41, "04": 0.50, "02_fixed": 22.0, "04_fixed": 15.0, "05_fixed": 55.0,
                 "05_tok": 55.0},
    "float32": {"fwd": 701.0, "02": 1.18, "04": 0.72, "02_fixed": 24.0, "04_fixed": 20.0, "05_fixed": 50.0,
                "05_tok": 45.0},
}


@dataclasses.dataclass(frozen=True)
class Rates:
    dtype: str
    reason: str
    forward_tok_s: float       # measured here
    slowdown: float            # the reference machine's forward rate / this one's (same dtype)


def measure(model_path, rows, requested="auto", seconds=3.0):
    """Rates of this machine: a timed forward of the verifier in the compute dtype over the longest of `rows` (cut to
    1,024 tokens)."""
    c = compute.resolve(requested, on_gpu=False)
    import torch
    import transformers
    from transformers import AutoModel
    transformers.utils.logging.disable_progress_bar()  # the estimate's lines are the only ones the reader needs
    torch.manual_seed(0)
    model, info = AutoModel.from_pretrained(model_path, dtype=c.torch(), output_loading_info=True)
    check_loaded(info, model_path)
    model.eval()
    ids = torch.tensor([max(rows, key=len)[:1024]])
    n = 0
    with torch.inference_mode():
        model(input_ids=ids[:, :128])  # warm-up: kernels, allocator
        t0 = time.time()
        while n == 0 or time.time() - t0 < seconds:
            model(input_ids=ids)
            n += 1
    rate = n * ids.shape[1] / (time.time() - t0)
    return Rates(c.dtype, c.reason, rate, REFERENCE[c.dtype]["fwd"] / rate)


def stage_seconds(r, tokens, epochs, prompts, new_tokens, batch_sizes):
    """{stage: seconds} for a run of `tokens` prepared tokens."""
    ref, s = REFERENCE[r.dtype], r.slowdown
    fwd = ref["fwd"] / s
    return {
        "02 extract": ref["02_fixed"] * s + tokens / (fwd * ref["02"]),
        "03 vocab map": 5.0,
        "04 train": ref["04_fixed"] * s + epochs * tokens / (fwd * ref["04"]),
        # two engines (without and with the draft), each generating prompts x new tokens at every batch size
        "05 evaluate": ref["05_fixed"] * s + 2 * len(batch_sizes) * prompts * new_tokens / (ref["05_tok"] / s),
    }


MIN_ROWS = 40  # below this a quickstart draft learns too little to measure (and the validation split is a row or two)


def fit(r, per_row_tokens, rows_max, budget_s, **kw):
    """The largest number of conversations (MIN_ROWS to rows_max) whose stages fit `budget_s`, and their seconds."""
    lo, hi = min(MIN_ROWS, rows_max), rows_max
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(stage_seconds(r, mid * per_row_tokens, **kw).values()) <= budget_s:
            lo = mid
        else:
            hi = mid - 1
    return lo, stage_seconds(r, lo * per_row_tokens, **kw)


def _fmt(seconds):
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def positive_int(text):
    """A count: a whole number >= 1 (argparse refuses anything else in one line)."""
    if not (text.strip().isascii() and text.strip().isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return int(text)


def minutes(text):
    """A time budget: a finite number of minutes > 0 (nan, inf, a negative or a word would size the run silently)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of minutes greater than 0, got {text!r}")
    return value


def sizes(text):
    """Batch sizes: whole numbers >= 1, separated by commas."""
    try:
        return [positive_int(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1 separated by commas, got {text!r}")


def main(argv=None):
    p = cli.Parser(description="How long stages 02-05 take here, from a short measurement.")
    p.add_argument("--model-path", required=True)
    p.add_argument("--prepared-data", required=True, help="stage 01 folder (its rows' lengths)")
    p.add_argument("--samples", type=positive_int, required=True,
                   help="conversations stage 01 read (the most to use)")
    p.add_argument("--epochs", type=positive_int, default=2)
    p.add_argument("--num-prompts", type=positive_int, default=8)
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--batch-sizes", type=sizes, default=[1, 4])
    p.add_argument("--dtype", choices=list(CHOICES), default="auto")
    p.add_argument("--budget-min", type=minutes, default=None,
                   help="print on stdout the number of conversations that fits this many minutes")
    a = p.parse_args(argv)
    rows_file = os.path.join(a.prepared_data, "tokenized_data.jsonl")
    if not os.path.isfile(rows_file):
        raise UsageError(f"--prepared-data {a.prepared_data}: no tokenized_data.jsonl; run 01_prepare_dataset.py")
    if visible_gpus():  # the quickstart's sizes are seconds of work for a GPU; the measurement here is a CPU one
        print(a.samples)
        return 0
    with open(rows_file, "rb") as f:
        rows = [json.loads(line)["input_ids"] for line in f]
    r = measure(a.model_path, rows, a.dtype)
    kw = dict(epochs=a.epochs, prompts=a.num_prompts, new_tokens=a.max_new_tokens, batch_sizes=a.batch_sizes)
    tokens = sum(len(x) for x in rows)
    full = stage_seconds(r, tokens, **kw)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731  (stdout carries the answer only)
    say(f"estimate: compute dtype {r.dtype} ({r.reason}); the verifier's forward runs at {r.forward_tok_s:,.0f} tok/s "
        f"here ({r.slowdown:.1f}x the reference machine's time)")
    say(f"estimate: {a.samples} conversations ({tokens:,} tokens), {a.epochs} epoch{'s' if a.epochs > 1 else ''}: " +
        ", ".join(f"{k} ~{_fmt(v)}" for k, v in full.items()) + f"; about {_fmt(sum(full.values()))} in all")
    if a.budget_min is None:
        return 0
    budget = a.budget_min * 60
    if sum(full.values()) <= budget:
        print(a.samples)
        return 0
    n, secs = fit(r, tokens / a.samples, a.samples, budget, **kw)  # per conversation read, skipped ones included
    over = sum(secs.values()) > budget
    say(f"estimate: that is over the {a.budget_min:.0f}-minute budget; {'even ' if over else ''}{n} conversations "
        f"{'take' if over else 'fit:'} about {_fmt(sum(secs.values()))}: fewer data, a weaker draft (set "
        f"NUM_SAMPLES={a.samples} to keep them all)")
    print(n)
    return 0


if __name__ == "__main__":
    cli.run(main)
