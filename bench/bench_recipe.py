"""The draft-recipe study (docs/RECIPE.md): one lever of stage 04 changed at a time from the embedded default's recipe,
at a fixed budget (SmolLM2-135M-Instruct, the quickstart's 300 ShareGPT conversations, 2 epochs, sequence length 2048,
draft vocabulary 8192), screened by the trainer's estimate and measured through vLLM by stage 05 on held-out prompts.

    python -m bench.bench_recipe prepare  --work W [--regen-temperature 0.8]   # stages 01, 03 + held-out prompts (CPU)
    python -m bench.bench_recipe extract  --work W                             # stage 02 per data variant
    python -m bench.bench_recipe train    --work W --arms all --seeds 0,1 [--parallel 6]   # stage 04 per arm and seed
    python -m bench.bench_recipe screen   --work W                             # the trainer's estimates, a table
    python -m bench.bench_recipe pack     --work W --runs R1,R2 --out DIR      # checkpoints to carry off a GPU machine
    python -m bench.bench_recipe unpack   --work W --src DIR                   # ... and back into W/ck here
    python -m bench.bench_recipe evaluate --work W --runs R1,R2 --name final   # one stage 05 over those drafts
    python -m bench.bench_recipe report   --work W --name final                # the table with its noise band

Every step runs the numbered scripts as a user would; W holds one folder per stage output, `ck/<arm>-s<seed>` per
training run. A step skips what W already holds (a run with a manifest), so a stopped study resumes. `pack` exists
because a GPU machine may train faster than it can send checkpoints back: it keeps each draft's trained tensors
in bf16 (the dtype vLLM serves them in on a bf16 CPU) and drops `embed_tokens`, after checking it is the verifier's
own (stage 04 freezes it); `unpack` puts the verifier's embedding back, so stage 05 serves what it would have.
"""
import argparse
import concurrent.futures
import json
import os
import re
import statistics
import subprocess
import sys

from bench.common import REPO, result

CFG = "configs/smollm2-135m.yaml"
MODEL = "data/models/smollm2-135m-instruct"
# one lever each, from the config's recipe (llama layer, norm before fc, norm on the output, kl_div, 3 TTT steps with
# no decay, Muon, linear schedule, lr 3e-3); `regen` arms train on the verifier's own sampled answers
ARMS = {
    "baseline": [],
    "no-norm-before-fc": ["--no-norm-before-fc"],
    "fc-norm": ["--fc-norm", "--no-norm-before-fc"],  # it replaces the norm the configs turn on
    "no-norm-output": ["--no-norm-output"],
    "qwen3-layer": ["--draft-arch", "qwen3"],
    **{f"loss-{n}": ["--loss-fn", n] for n in ("rkl", "jsd", "ce", "tv", "nla", "lk_hybrid")},
    "ttt2": ["--ttt-steps", "2"], "ttt5": ["--ttt-steps", "5"], "decay0.8": ["--ttt-step-loss-decay", "0.8"],
    "ttt2-decay0.8": ["--ttt-steps", "2", "--ttt-step-loss-decay", "0.8"],
    "ttt5-decay0.8": ["--ttt-steps", "5", "--ttt-step-loss-decay", "0.8"],
    "lr1e-3": ["--lr", "1e-3"], "lr6e-3": ["--lr", "6e-3"], "lr1.2e-2": ["--lr", "1.2e-2"],
    "cosine": ["--scheduler", "cosine"],
    "adamw": ["--optimizer", "adamw"],
    "regen": [],
}
CODE = re.compile(r"```|\b(code|python|javascript|typescript|java|c\+\+|c#|sql|bash|regex|html|css|react|function|"
                  r"script|api|json|def|class|compile|bug|program)\b", re.I)


def py(*args, log, env=None):
    """A numbered script (or module) of this repository, its output to `log`. -> exit status."""
    with open(log, "w") as f:
        return subprocess.run([sys.executable, *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env).returncode


def must(code, what, log):
    if code:
        sys.exit(f"{what} failed ({code}); see {log}")


def data_of(arm):
    return "regen" if arm.startswith("regen") else "orig"


def prepare(w, n, regen_t, prompts_per_kind):
    os.makedirs(f"{w}/logs", exist_ok=True)
    variants = [("orig", [])] + ([("regen", ["--regenerate", "--regen-temperature", str(regen_t),
                                             "--regen-max-tokens", "1024", "--seed", "0"])] if regen_t else [])
    for v, extra in variants:
        if not os.path.isfile(f"{w}/prep_{v}/manifest.json"):
            must(py("01_prepare_dataset.py", "--config", CFG, "--num-samples", str(n), "--output-dir",
                    f"{w}/prep_{v}", *extra, log=f"{w}/logs/prep_{v}.log"), f"stage 01 ({v})", f"{w}/logs/prep_{v}.log")
        if not os.path.isfile(f"{w}/vocab_{v}/manifest.json"):
            must(py("03_build_vocab_mapping.py", "--config", CFG, "--prepared-data", f"{w}/prep_{v}", "--output-dir",
                    f"{w}/vocab_{v}", log=f"{w}/logs/vocab_{v}.log"), f"stage 03 ({v})", f"{w}/logs/vocab_{v}.log")
    held_out(w, prompts_per_kind)


def held_out(w, per_kind, prep="prep_orig"):
    """`per_kind` chat and `per_kind` code prompts: first user turns of ShareGPT records after every record stage 01
    read (so none trained on), short enough to leave room for the answer, none repeated, none in the training rows."""
    path = f"{w}/heldout.jsonl"
    if os.path.isfile(path):
        return
    from eagle3pipe.chat.conversations import iter_records
    from eagle3pipe.chat.messages import normalize
    from eagle3pipe.chat.masks import load_tokenizer
    tok = load_tokenizer(MODEL, False)
    skip = json.load(open(f"{w}/{prep}/manifest.json"))["counts"]["records_read"]
    kinds, firsts = {"chat": [], "code": []}, set()  # firsts: every user turn seen, training records' included
    for i, (where, rec) in enumerate(iter_records("sharegpt")):
        try:
            msgs = normalize(where, rec)[1]
        except Exception:
            continue
        turns = [m["content"] for m in msgs if m["role"] == "user"]
        if i < skip or not turns or len(turns[0]) < 8 or turns[0] in firsts:
            firsts.update(turns)
            continue
        turn = {"content": turns[0]}
        if len(tok(turn["content"])["input_ids"]) > 384:
            continue
        kind = "code" if CODE.search(turn["content"]) else "chat"
        if len(kinds[kind]) < per_kind:
            kinds[kind].append({"record": i, "kind": kind, "conversations": [{"from": "human", "value": turn["content"]}]})
            firsts.add(turn["content"])
        if all(len(v) >= per_kind for v in kinds.values()):
            break
    rows = [r for pair in zip(kinds["chat"], kinds["code"]) for r in pair]
    with open(path + ".tmp", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(path + ".tmp", path)
    print(f"held-out prompts: {len(rows)} ({per_kind} chat, {per_kind} code), ShareGPT records {rows[0]['record']}-"
          f"{max(r['record'] for r in rows)} (stage 01 read records 0-{skip - 1})")


def extract(w, backend):
    for v in ("orig", "regen"):
        if os.path.isdir(f"{w}/prep_{v}") and not os.path.isfile(f"{w}/hs_{v}/manifest.json"):
            log = f"{w}/logs/extract_{v}.log"
            must(py("02_extract_hidden_states.py", "--config", CFG, "--backend", backend, "--prepared-data",
                    f"{w}/prep_{v}", "--output-dir", f"{w}/hs_{v}", log=log), f"stage 02 ({v})", log)


def train_one(w, arm, seed, flags, workers, extra_flags=()):
    run, v = f"{arm}-s{seed}", data_of(arm)
    if os.path.isfile(f"{w}/ck/{run}/manifest.json"):
        return run, 0, "done earlier"
    extra = ["--num-workers", str(workers)] if workers is not None else []
    log = f"{w}/logs/train_{run}.log"
    code = py("04_train.py", "--config", CFG, "--prepared-data", f"{w}/prep_{v}", "--hidden-states", f"{w}/hs_{v}",
              "--vocab-mapping", f"{w}/vocab_{v}", "--output-dir", f"{w}/ck/{run}", "--seed", str(seed), *extra,
              *extra_flags, *flags, log=log)
    return run, code, log


def train(w, arms, seeds, parallel, workers, custom, extra_flags=()):
    table = {**ARMS, **custom}
    jobs = [(a, s, table[a]) for s in seeds for a in arms]
    os.makedirs(f"{w}/ck", exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        for run, code, log in pool.map(lambda j: train_one(w, *j, workers, extra_flags), jobs):
            print(f"{run}: {'ok' if code == 0 else f'FAILED ({code}), see {log}'}", flush=True)


def estimates(w):
    """{run: {"epochs": {epoch: expected acceptance}, "best": ..., "best_epoch": ...}} from each checkpoint's
    val_metrics.json (the trainer's per-position accuracies on the validation rows)."""
    from eagle3pipe.train.checkpoints import expected_acceptance
    out = {}
    for run in sorted(os.listdir(f"{w}/ck")):
        eps = {}
        for e in sorted((d for d in os.listdir(f"{w}/ck/{run}") if d.isdigit()), key=int):
            p = f"{w}/ck/{run}/{e}/val_metrics.json"
            if os.path.isfile(p):
                eps[e] = expected_acceptance(json.load(open(p)))
        best = os.path.basename(os.path.realpath(f"{w}/ck/{run}/checkpoint_best"))
        if eps:
            out[run] = {"epochs": eps, "best_epoch": best, "best": eps.get(best)}
    return out


def arm_table(per_run, key):
    """{arm: [value per seed]} from {run: {...key...}}."""
    arms = {}
    for run, r in sorted(per_run.items()):
        arm, _ = run.rsplit("-s", 1)
        if r.get(key) is not None:
            arms.setdefault(arm, []).append(r[key])
    return arms


def table(arms, base="baseline"):
    """Markdown rows: arm, seeds, mean, range, difference to the baseline, and whether it is outside the noise band
    (the largest seed-to-seed spread of any arm with two seeds)."""
    spreads = [max(v) - min(v) for v in arms.values() if len(v) >= 2]
    band = max(spreads) if spreads else None
    b = statistics.mean(arms[base]) if base in arms else None
    rows = ["| arm | seeds | mean | per seed | vs baseline | outside the band |", "| --- | ---: | ---: | --- | ---: | --- |"]
    for arm, v in sorted(arms.items(), key=lambda kv: -statistics.mean(kv[1])):
        m = statistics.mean(v)
        d = m - b if b is not None else None
        verdict = "-" if d is None or band is None or arm == base else ("**yes**" if abs(d) > band else "no (none)")
        rows.append(f"| {arm} | {len(v)} | {m:.3f} | {' / '.join(f'{x:.3f}' for x in v)} | "
                    f"{'' if d is None else f'{d:+.3f}'} | {verdict} |")
    return rows, band


def pack_one(w, run, ck, dst):
    """One checkpoint `ck` of `run` as one bf16 safetensors without `embed_tokens` (checked equal to the verifier's),
    its config, val_metrics and the run's manifest (when it has one) in the metadata; split in 15 MB parts for the
    transfer limit. `unpack` reverses it."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    os.makedirs(dst, exist_ok=True)
    with safe_open(f"{MODEL}/model.safetensors", "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    tensors = {}
    with safe_open(f"{ck}/model.safetensors", "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            if k == "embed_tokens.weight":
                if not torch.equal(t.to(embed.dtype), embed):
                    sys.exit(f"{run}: embed_tokens differs from the verifier's; cannot drop it")
                continue
            tensors[k] = t.to(torch.bfloat16) if t.is_floating_point() else t
    meta = {"epoch": os.path.basename(ck),
            **{n: open(p).read() for n, p in (("config.json", f"{ck}/config.json"),
                                               ("val_metrics.json", f"{ck}/val_metrics.json"),
                                               ("manifest.json", f"{w}/ck/{run}/manifest.json")) if os.path.isfile(p)}}
    save_file(tensors, f"{dst}/{run}.safetensors", metadata=meta)
    subprocess.run(["split", "-b", "15M", "-d", f"{dst}/{run}.safetensors", f"{dst}/{run}.part"], check=True)
    os.remove(f"{dst}/{run}.safetensors")


def pack(w, runs, dst):
    """Each run's checkpoint_best, packed (pack_one)."""
    for run in runs:
        pack_one(w, run, os.path.realpath(f"{w}/ck/{run}/checkpoint_best"), dst)
    print(json.dumps(estimates(w)))


def unpack(w, src):
    """The reverse of pack, into W/ck/<run>/<epoch>/ with checkpoint_best pointing at it."""
    import glob
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(f"{MODEL}/model.safetensors", "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    runs = sorted({os.path.basename(p).rsplit(".part", 1)[0] for p in glob.glob(f"{src}/*.part*")})
    for run in runs:
        whole = f"{w}/{run}.safetensors"
        with open(whole, "wb") as out:
            for part in sorted(glob.glob(f"{src}/{run}.part*")):
                out.write(open(part, "rb").read())
        with safe_open(whole, "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        cfg = json.loads(meta["config.json"])
        tensors["embed_tokens.weight"] = embed.to(torch.bfloat16)
        d = f"{w}/ck/{run}/{meta['epoch']}"
        os.makedirs(d, exist_ok=True)
        save_file(tensors, f"{d}/model.safetensors")
        for n in ("config.json", "val_metrics.json"):
            open(f"{d}/{n}", "w").write(meta[n])
        if "manifest.json" in meta:  # a run stopped before its end has none
            open(f"{w}/ck/{run}/manifest.json", "w").write(meta["manifest.json"])
        link = f"{w}/ck/{run}/checkpoint_best"
        if not os.path.islink(link):
            os.symlink(meta["epoch"], link)
        os.remove(whole)
        print(f"{run}: epoch {meta['epoch']}, {len(tensors)} tensors, draft vocab {cfg.get('draft_vocab_size')}")


def evaluate(w, runs, name, batch):
    drafts = [f"{w}/ck/{r}/checkpoint_best" for r in runs]
    log = f"{w}/logs/eval_{name}.log"
    must(py("05_evaluate.py", "--config", CFG, "--draft", *drafts, "--prompts", f"{w}/heldout.jsonl",
            "--prepared-data", f"{w}/prep_orig", "--num-prompts", "1000000", "--max-new-tokens", "128",
            "--num-speculative-tokens", "3", "--batch-sizes", str(batch), "--output-dir", f"{w}/eval_{name}",
            log=log), "stage 05", log)


def report(w, name):
    rep = json.load(open(f"{w}/eval_{name}/report.json"))
    per_run = {}
    for r in rep["ranking"] or []:
        run = os.path.basename(os.path.dirname(r["draft"]))
        per_run[run] = {"vllm": r["acceptance_length"], "trainer": r["trainer"], "per_position": r["per_position"]}
    rows, band = table(arm_table(per_run, "vllm"))
    print("\n".join(rows))
    result({"name": name, "band": band, "runs": per_run, "num_prompts": rep["num_prompts"]})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=["prepare", "extract", "train", "screen", "pack", "unpack", "evaluate", "report"])
    p.add_argument("--work", required=True)
    p.add_argument("--num-samples", type=int, default=300)
    p.add_argument("--regen-temperature", type=float, default=0.0, help="also prepare the regenerated data (>0)")
    p.add_argument("--prompts-per-kind", type=int, default=50)
    p.add_argument("--backend", default="hf", help="stage 02's backend")
    p.add_argument("--arms", default="all", help="comma list of ARMS names, or all")
    p.add_argument("--custom", action="append", default=[], help="NAME=FLAGS: another arm (a combination)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--parallel", type=int, default=1, help="training runs at once (a GPU has room for several)")
    p.add_argument("--num-workers", type=int, default=None)
    p.add_argument("--extra", default="", help="flags every training run gets (how, not what: e.g. the loss kernel)")
    p.add_argument("--runs", default="", help="comma list of <arm>-s<seed>")
    p.add_argument("--out", default="")
    p.add_argument("--src", default="")
    p.add_argument("--name", default="final")
    p.add_argument("--batch-size", type=int, default=1)
    a = p.parse_args()
    w = os.path.abspath(a.work)
    os.makedirs(f"{w}/logs", exist_ok=True)
    custom = {k: v.split() for k, v in (c.split("=", 1) for c in a.custom)}
    arms = [x for name in a.arms.split(",") for x in (list(ARMS) if name == "all" else [name])]
    if not os.path.isdir(f"{w}/prep_regen"):
        arms = [x for x in arms if data_of(x) == "orig"]
    seeds = [int(s) for s in a.seeds.split(",")]
    runs = [r for r in a.runs.split(",") if r]
    if a.step == "prepare":
        prepare(w, a.num_samples, a.regen_temperature, a.prompts_per_kind)
    elif a.step == "extract":
        extract(w, a.backend)
    elif a.step == "train":
        train(w, arms, seeds, a.parallel, a.num_workers, custom, a.extra.split())
    elif a.step == "screen":
        est = estimates(w)
        rows, band = table(arm_table(est, "best"))
        print("\n".join(rows))
        result({"band": band, "runs": est})
    elif a.step == "pack":
        pack(w, runs, a.out)
    elif a.step == "unpack":
        unpack(w, a.src)
    elif a.step == "evaluate":
        evaluate(w, runs, a.name, a.batch_size)
    else:
        report(w, a.name)


if __name__ == "__main__":
    main()
