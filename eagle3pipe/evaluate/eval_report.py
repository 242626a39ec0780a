"""Stage 05's report: report.json, acceptance.png, the manifest, and the table and lines it prints."""
import importlib.metadata
import os

from ..adapters import _dist
from ..storage import files
from .evaluation import explain, reconcile


def versions():
    """The engine and libraries behind the figures: a moved figure is read against them."""
    out = {}
    for name in ("vllm", "torch", "transformers", "speculators"):
        try:
            dist = _dist(name) if name == "vllm" else importlib.metadata.distribution(name)
            out[name] = dist.version if dist else None
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def build(args, plan, sizes, base, spec, ranking, measured):
    """-> the report (report.json): batch 1's figures are the headline, as in the ranking and the measure."""
    if plan.without_vllm:
        return build_measured(args, plan, ranking, measured)
    best = ranking[0]["draft"]
    diffs = spec[1].pop("divergences")
    return {
        "draft": os.path.realpath(best),
        "ranking": [{**r, "speedup": round(r["tokens_per_s"] / base[1]["tokens_per_s"], 3)} for r in ranking]
        if len(plan.drafts) > 1 else None,
        "trainer_vs_vllm": reconcile(best, spec[1]), "config_mismatches": plan.mismatches,
        "measure_vs_vllm": measured,
        # batch 1, as the ranking and the measure: a larger batch's bf16 outputs depend on the batch's shape
        "acceptance_length": spec[1]["acceptance_length"], "num_prompts": len(plan.prompts),
        "compute_dtype": plan.dtype.dtype,
        "greedy_identical_at_batch_1": f"{len(plan.prompts) - len(diffs)}/{len(plan.prompts)}",
        "greedy_divergences": diffs,
        "baseline": {b: {k: v for k, v in r.items() if k != "outputs"} for b, r in base.items()},
        "speculative": {b: {k: v for k, v in r.items() if k != "outputs"} for b, r in spec.items()},
        "speedup": {b: round(spec[b]["tokens_per_s"] / base[b]["tokens_per_s"], 3) for b in sizes},
        "engine": "vllm", "versions": versions(),
    }


def build_measured(args, plan, ranking, measured):
    """The report of the measure alone: acceptance per draft and per position, by eagle3pipe/measures/acceptance.py (its
    figure equals vLLM's on the same outputs, tests/e2e), no speed-up (that needs vLLM)."""
    best = ranking[0]
    return {
        "draft": best["draft"], "engine": "measure", "without_vllm": plan.without_vllm,
        "acceptance_length": best["acceptance_length"], "per_position": best["per_position"],
        "ranking": ranking if len(plan.drafts) > 1 else None, "num_prompts": len(plan.prompts),
        "num_speculative_tokens": args.num_speculative_tokens, "max_new_tokens": args.max_new_tokens,
        "config_mismatches": plan.mismatches, "reference_seconds": measured["reference_seconds"],
        "speedup": None, "speedup_note": "speed-up needs vLLM: run stage 05 where vLLM serves the draft",
        "versions": versions(),
    }


def write(out, args, plan, report):
    files.begin_output(out)
    files.write_json(os.path.join(out, "report.json"), report)
    with files.atomic_path(os.path.join(out, "acceptance.png")) as tmp:
        plot(report, plan.train_metrics, tmp)
    files.write_json(os.path.join(out, files.MANIFEST), files.manifest(
        "evaluate", args, verifier=plan.fp, draft=report["draft"], skipped_records=plan.skip, report=report))


def print_table(args, report):
    if report["engine"] == "measure":
        return print_measured(args, report)
    print(f"\n{'batch':>5} {'accept len':>10} {'per-position acceptance':>26} {'tok/s base':>10} {'tok/s spec':>10} "
          f"{'speed-up':>8}")
    for b, s in report["speculative"].items():
        pos = " ".join(f"{x:.2f}" for x in s["per_position"])
        print(f"{b:>5} {s['acceptance_length'] or 0:>10.3f} {pos:>26} {report['baseline'][b]['tokens_per_s']:>10.1f} "
              f"{s['tokens_per_s']:>10.1f} {report['speedup'][b]:>7.2f}x")
    for line in summary(report):
        print(line)
    print(f"{explain(report['greedy_divergences'], report['num_prompts'])}; report: "
          f"{os.path.join(args.output_dir, 'report.json')}")
    print(verdict(report, args.num_speculative_tokens))


def verdict(report, k):
    """Whether the draft pays for itself on this machine, and why: its speed-up at batch 1 and at the largest batch
    measured, against the acceptance that bought it (a round costs k draft steps and one verification of k + 1
    tokens, and yields the acceptance length in tokens)."""
    speedup = {int(b): v for b, v in report["speedup"].items()}
    one, most = speedup.get(1, speedup[min(speedup)]), max(speedup)
    a = report["acceptance_length"] or 0.0
    at = f"{one:.2f}x at batch 1" + (f", {speedup[most]:.2f}x at batch {most}" if most != 1 else "")
    if one >= 1.0:
        return (f"verdict: the draft pays for itself here ({at}): a round of {k} draft steps and one verification "
                f"yields {a:.2f} tokens, which costs less than {a:.2f} of the verifier's own steps")
    return (f"verdict: the draft does not pay for itself here ({at}): a round of {k} draft steps and one "
            f"verification yields {a:.2f} tokens, too few to cover the draft's steps and the verification on this "
            f"device; a draft trained on more conversations and epochs accepts more (docs/RECIPE.md)")


def print_measured(args, report):
    rows = report["ranking"] or [{"name": os.path.basename(report["draft"]), **report}]
    print(f"\n{'checkpoint':>24} {'accept len':>10} {'per-position acceptance':>26}   (the measure without vLLM)")
    for r in rows:
        pos = " ".join(f"{x:.2f}" for x in r["per_position"])
        print(f"{str(r['name'])[-24:]:>24} {r['acceptance_length'] or 0:>10.3f} {pos:>26}")
    print(f"acceptance length {report['acceptance_length']} by the measure without vLLM ({report['without_vllm']}), "
          f"k={report['num_speculative_tokens']}, {report['num_prompts']} prompts; best: {report['draft']}; "
          f"{report['speedup_note']}; report: {os.path.join(args.output_dir, 'report.json')}")


def _ranked(row):
    """One ranked checkpoint: its acceptance, speed-up and the time of one round (k draft steps and one
    verification) at batch 1, and the trainer's estimate where its run recorded one."""
    per_round, trainer = row["seconds_per_round"], row["trainer"]
    return (f"{row['name']} {row['acceptance_length']} ({row['speedup']:.2f}x"
            + (f", {per_round * 1000:.1f} ms a round" if per_round else "")
            + (f"; trainer {trainer:.2f})" if trainer else ")"))


def summary(report):
    """The lines stage 05 prints under its table: the ranking of several checkpoints, and the trainer's estimate
    beside vLLM's measurement."""
    lines = []
    if report.get("ranking"):
        lines.append("checkpoints by acceptance length through vLLM (batch 1): "
                     + ", ".join(_ranked(r) for r in report["ranking"]) + f"; best: {report['draft']}")
    rec = report.get("trainer_vs_vllm") or {}
    if rec.get("trainer") is not None:
        pos = " ".join(f"{t:.2f}/{v:.2f}" for t, v in rec.get("per_position", []))
        lines.append(f"acceptance length: trainer's estimate {rec['trainer']:.2f} on its validation rows, vLLM "
                     f"{rec['vllm']} on these prompts (per position, trainer/vLLM: {pos})")
    if rec.get("note"):
        lines.append(rec["note"])
    m = report.get("measure_vs_vllm") or {}
    if m.get("acceptance_length") is not None:
        pos = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(m["per_position"], m["vllm_per_position"]))
        lines.append(f"acceptance length without vLLM (eagle3pipe/measures/acceptance.py, float32): {m['acceptance_length']}, "
                     f"vLLM {m['vllm']} (per position, measure/vLLM: {pos}); the same figure at every position of "
                     f"the same outputs, the trainer's formula: {m['position_average']}")
    return lines


def plot(report, train_metrics, path):
    """Per-position acceptance (left), the training curves from stage 04's metrics.jsonl (middle) and, with several
    checkpoints, their acceptance lengths with the best marked (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ranking = report.get("ranking") or []
    fig, axes = plt.subplots(1, 3 if ranking else 2, figsize=(16 if ranking else 11, 4))
    a, b = axes[0], axes[1]
    if ranking:
        c = axes[2]
        order = sorted(ranking, key=lambda r: int(r["name"]) if str(r["name"]).isdigit() else 0)
        colors = ["tab:green" if r["draft"] == report.get("draft") else "tab:gray" for r in order]
        c.bar([str(r["name"]) for r in order], [r["acceptance_length"] or 0 for r in order], color=colors,
              label="vLLM" if report["engine"] == "vllm" else "the measure without vLLM")
        if any(r["trainer"] for r in order):
            c.plot([str(r["name"]) for r in order], [r["trainer"] or float("nan") for r in order], "ko--",
                   label="trainer's estimate")
        c.set(title="acceptance length by checkpoint (best in green)", xlabel="epoch", ylabel="acceptance length",
              ylim=(1, None))
        c.legend()
    curves = {f"batch {bs}": r for bs, r in report["speculative"].items()} if report["engine"] == "vllm" else \
        {"the measure without vLLM": report}
    for label, r in curves.items():
        if r.get("per_position"):
            a.plot(range(1, len(r["per_position"]) + 1), r["per_position"], marker="o", label=label)
    a.set(title=f"acceptance by draft position (mean length {report['acceptance_length']})",
          xlabel="draft position", ylabel="accepted fraction", ylim=(0, 1))
    a.legend()
    train = [m for m in train_metrics if "train" in m]
    if train:
        steps = [m["global_step"] for m in train]
        b.plot(steps, [m["train"]["loss"] for m in train], color="black", label="train loss (sum over positions)")
        b.set(title="stage 04 training", xlabel="step", ylabel="loss")
        acc = b.twinx()
        for key in sorted(k for k in train[-1]["train"] if k.startswith("full_acc_")):
            acc.plot(steps, [m["train"].get(key, 0) for m in train], "--", label=key.replace("full_", ""))
        acc.set(ylabel="accuracy", ylim=(0, 1))
        acc.legend(loc="upper right")
        b.legend(loc="upper left")
    else:
        b.text(0.5, 0.5, "no stage 04 metrics found", ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")  # the path is a temporary name without .png
    plt.close(fig)
