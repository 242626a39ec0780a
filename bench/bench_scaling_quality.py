"""The scaling study (docs/RECIPE.md, "Data is the lever"): the embedded verifier's draft trained on 300 to all of the
package's ShareGPT conversations, every epoch measured on held-out prompts by the acceptance measure without vLLM
(eagle3pipe/measures/acceptance.py) at k=3 and k=5, the best draft of each size confirmed through vLLM by stage 05.

    python -m bench.bench_scaling_quality study   --work W --parallel 6  # all of the below, in order (GPU + vLLM):
                                                # the data curve (STUDY), the levers at all the data (LEVERS)
    python -m bench.bench_scaling_quality prepare --work W [--vocab 16384,32768]  # stages 01 + 03 on all but the
                                                # last 500 records, 200 held-out prompts from those (CPU)
    python -m bench.bench_scaling_quality carry   --work W --out D    # W's inputs, xz, in 30 MB parts (transfer limit)
    python -m bench.bench_scaling_quality uncarry --work W --src D
    python -m bench.bench_scaling_quality extract --work W --states S # stage 02 (HF, fp8) once, for every size
    python -m bench.bench_scaling_quality check   --work W --runs ... [--extra ...]  # stage 04's flag checks,
                                                # every run, in seconds (CPU): before any GPU time
    python -m bench.bench_scaling_quality train   --work W --states S --runs 300:10:0,1000:10:0,all:3:0 --parallel 4
    python -m bench.bench_scaling_quality measure --work W            # every epoch of every run, k=3 and k=5
    python -m bench.bench_scaling_quality pack    --work W --runs n300-s0,... --out D   # best epochs, bf16
    python -m bench.bench_scaling_quality confirm --work W --runs ... --name N          # stage 05 through vLLM
    python -m bench.bench_scaling_quality report  --work W [--plot docs/scaling_quality.png]
    python -m bench.bench_scaling_quality curve   --work W --src bench/results/scaling_quality_20261202.json \
        --plot docs/scaling_quality.png             # the data curve from a results file
    python -m bench.bench_scaling_quality compare --work W --src a.json,b.json --runs RUN/EP:RUN/EP,... [--k 5]
                                                # paired differences between measured epochs, with 95% bands
                                                # (RUN/EP+RUN/EP on a side pools two seeds prompt by prompt)

A run is SIZE:EPOCHS:SEED[:TOKENS[:LEVERS]]. SIZE is a row count (stage 04's --num-samples: the first N rows of
stage 01's shuffled output, a random subset of the training records) or `all`; TOKENS, when given, is the tokens per
step (--total-seq-len; the config's 2048 otherwise); LEVERS, '+'-joined: L<n> draft layers, v<n> the draft
vocabulary built by `prepare --vocab n`, e<n> the epoch count in the run's name, or an arm of the first study
(bench_recipe.ARMS, e.g. `all:3:0:32768:v32768+L2+fc-norm`). `measure --watch S` measures epochs
as they appear while `train` runs (it marks W/training), for at most S seconds. Every step runs the numbered scripts
as a user would and skips what W already holds, so a stopped study resumes. The measure runs on a GPU when there is
one: references (the verifier's greedy continuation of each prompt, 128 + 5 tokens, EOS not stopping it) are made
once, batched, in float32, and stored in W/refs.pt; each checkpoint is then one TTT forward per prompt.
"""
import argparse
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import time

from bench.bench_recipe import ARMS, CFG, MODEL, held_out, must, pack_one, py, unpack
from bench.common import REPO, result

K, MAX_NEW = 5, 128  # one forward with 5 TTT steps gives k=3 (its first 3 steps) and k=5


def prepare(w, holdout, per_kind, vocabs=()):
    from eagle3pipe.chat.conversations import iter_records
    os.makedirs(f"{w}/logs", exist_ok=True)
    if not os.path.isfile(f"{w}/prep/manifest.json"):
        total = sum(1 for _ in iter_records("sharegpt"))
        must(py("01_prepare_dataset.py", "--config", CFG, "--num-samples", str(total - holdout), "--output-dir",
                f"{w}/prep", log=f"{w}/logs/prep.log"), "stage 01", f"{w}/logs/prep.log")
    if not os.path.isfile(f"{w}/vocab/manifest.json"):
        must(py("03_build_vocab_mapping.py", "--config", CFG, "--prepared-data", f"{w}/prep", "--output-dir",
                f"{w}/vocab", log=f"{w}/logs/vocab.log"), "stage 03", f"{w}/logs/vocab.log")
    for n in vocabs:  # the vocabulary lever's mappings (a run's v<n>)
        if not os.path.isfile(f"{w}/vocab{n}/manifest.json"):
            must(py("03_build_vocab_mapping.py", "--config", CFG, "--prepared-data", f"{w}/prep", "--draft-vocab-size",
                    str(n), "--output-dir", f"{w}/vocab{n}", log=f"{w}/logs/vocab{n}.log"), "stage 03",
                 f"{w}/logs/vocab{n}.log")
    held_out(w, per_kind, prep="prep")


def carry(w, dst):
    """W's inputs as one xz stream in 30 MB parts: xz keeps all 16,221 rows (151 MB of token ids) in one 21 MB part,
    gzip took two."""
    os.makedirs(dst, exist_ok=True)
    vocabs = " ".join(sorted(d for d in os.listdir(w) if d.startswith("vocab")))  # the levers' mappings too
    subprocess.run(f"tar -C {w} -cf - prep {vocabs} heldout.jsonl | xz -T0 -6 | split -b 30M -d - {dst}/inputs.part",
                   shell=True, check=True)


def uncarry(w, src):
    """carry's parts unpacked into W (Python's own xz, in case the machine lacks the xz tool); skipped when W holds
    them already."""
    import tarfile
    os.makedirs(w, exist_ok=True)
    if not os.path.isfile(f"{w}/prep/manifest.json"):
        cat = subprocess.Popen(["cat", *sorted(glob.glob(f"{src}/inputs.part*"))], stdout=subprocess.PIPE)
        with tarfile.open(fileobj=cat.stdout, mode="r|xz") as tar:
            tar.extractall(w, filter="data")
        if cat.wait():
            sys.exit(f"uncarry: reading {src}/inputs.part* failed")


def extract(w, states):
    if not os.path.isfile(f"{states}/manifest.json"):
        log = f"{w}/logs/extract.log"
        must(py("02_extract_hidden_states.py", "--config", CFG, "--backend", "hf", "--storage-dtype", "fp8",
                "--batch-size", "16", "--prepared-data", f"{w}/prep", "--output-dir", states, log=log), "stage 02", log)


def run_name(size, seed, tokens=None, levers=None):
    return f"n{size}-s{seed}" + (f"-t{tokens}" if tokens else "") + (f"-{levers.replace('+', '-')}" if levers else "")


def lever_flags(w, levers, epochs):
    """A run's levers, '+'-joined: L<n> draft layers, v<n> the draft vocabulary W/vocab<n> (stage 03 with
    --draft-vocab-size n), e<n> the epoch count in the run's name (it must equal EPOCHS), or an arm of the first
    study (bench_recipe.ARMS: fc-norm, qwen3-layer, loss-jsd, ttt5-decay0.8, lr6e-3, cosine, ...)."""
    flags = []
    for lever in filter(None, (levers or "").split("+")):
        kind, n = lever[0], lever[1:]
        if lever in ARMS:
            flags += ARMS[lever]
        elif kind == "L" and n.isdigit():
            flags += ["--num-layers", n]
        elif kind == "v" and os.path.isfile(f"{w}/vocab{n}/manifest.json"):
            flags += ["--vocab-mapping", f"{w}/vocab{n}"]
        elif not (kind == "e" and n == epochs):
            sys.exit(f"--runs: lever {lever!r} is not L<layers>, v<vocab size with W/vocab<n>>, e{epochs} or an arm of "
                     f"bench_recipe.ARMS")
    return flags


def plan_runs(w, specs):
    """Each SIZE:EPOCHS:SEED[:TOKENS[:LEVERS]] as (name, size, epochs, seed, tokens, flags), every spec checked before
    any run starts. Two specs with one name would train into one folder (the name holds no epoch count unless an
    e<n> lever puts it there): refused, naming both."""
    plans, names = [], {}
    for spec in specs:
        size, epochs, seed, *rest = spec.split(":")  # optional: tokens per step (--total-seq-len), levers
        tokens, levers = (rest + [None, None])[:2]
        name = run_name(size, seed, tokens, levers)
        if name in names:
            sys.exit(f"--runs: {names[name]!r} and {spec!r} both train into ck/{name}; tell them apart with an "
                     f"e<epochs> lever (e.g. '{spec}{'+' if levers else ':' if tokens else '::'}e{epochs}')")
        names[name] = spec
        plans.append((name, size, epochs, seed, tokens, lever_flags(w, levers, epochs)))
    return plans


def train_argv(w, states, plan, extra):
    """Stage 04's flags for one planned run."""
    name, size, epochs, seed, tokens, flags = plan
    return ["--config", CFG, "--prepared-data", f"{w}/prep", "--hidden-states", states, "--vocab-mapping",
            f"{w}/vocab", "--output-dir", f"{w}/ck/{name}", "--epochs", epochs, "--seed", seed,
            *([] if size == "all" else ["--num-samples", size]), *(["--total-seq-len", tokens] if tokens else []),
            *flags, *extra]


def check(w, states, runs, extra):
    """Every run's flags through stage 04's own resolution (the config, the flags, their contradictions), in
    seconds and on any machine: a run the GPU machine would refuse after stage 02 is refused here first."""
    from eagle3pipe.config.cli import load_script
    from eagle3pipe.base.errors import UsageError
    stage = load_script("04_train.py")
    bad = 0
    for plan in plan_runs(w, runs):
        try:
            stage.parse_args(train_argv(w, states, plan, extra))
            print(f"{plan[0]}: flags ok")
        except (UsageError, SystemExit) as e:
            bad += 1
            print(f"{plan[0]}: stage 04 refuses its flags: {e}")
    if bad:
        sys.exit(f"--runs: {bad} run(s) stage 04 would refuse")


def train(w, states, runs, parallel, extra):
    import concurrent.futures
    os.makedirs(f"{w}/ck", exist_ok=True)
    plans = plan_runs(w, runs)

    def one(plan):
        name = plan[0]
        if os.path.isfile(f"{w}/ck/{name}/manifest.json"):
            return name, 0, "done earlier"
        log = f"{w}/logs/train_{name}.log"
        return name, py("04_train.py", *train_argv(w, states, plan, extra), log=log), log

    open(f"{w}/training", "w").close()  # measure --watch runs while this exists
    try:
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            for name, code, log in pool.map(one, plans):
                print(f"{name}: {'ok' if code == 0 else f'stopped ({code}), see {log}'}", flush=True)
    finally:
        os.remove(f"{w}/training")


def prompts(w):
    from eagle3pipe.chat.messages import normalize
    from eagle3pipe.chat.masks import load_tokenizer, prompt_ids
    tok = load_tokenizer(MODEL, False)
    rows = [json.loads(line) for line in open(f"{w}/heldout.jsonl")]
    return [prompt_ids(tok, normalize(f"heldout:{i}", r)[1]) for i, r in enumerate(rows)], [r["kind"] for r in rows]


def references(w, device):
    """The verifier's greedy continuation of every prompt, batched with left padding and a KV cache (plain argmax,
    EOS not stopping it), then each prompt + continuation once more, alone, through the hooked verifier for its
    auxiliary states (acceptance.Verifier's layer ids and convention). Stored in W/refs.pt."""
    import torch
    path = f"{w}/refs.pt"
    if os.path.isfile(path):
        return torch.load(path)
    from eagle3pipe.measures import acceptance
    ids, kinds = prompts(w)
    # the draft's inputs, from any saved checkpoint (a run stopped before its manifest has them too)
    layer_ids = json.load(open(glob.glob(f"{w}/ck/*/[0-9]*/config.json")[0]))["eagle_aux_hidden_state_layer_ids"]
    ver = acceptance.Verifier(MODEL, layer_ids, "float32", device)
    model, t0, n_new = ver.model, time.time(), MAX_NEW + K
    conts = []
    with torch.inference_mode():
        for b in range(0, len(ids), 50):
            chunk = ids[b:b + 50]
            width = max(map(len, chunk))
            inp = torch.tensor([[0] * (width - len(x)) + x for x in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk], device=device)
            out = model(input_ids=inp, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                        use_cache=True)
            new = []
            for _ in range(n_new):
                nxt = out.logits[:, -1].argmax(-1)
                new.append(nxt)
                mask = torch.cat([mask, mask.new_ones(len(chunk), 1)], 1)
                out = model(input_ids=nxt[:, None], attention_mask=mask, past_key_values=out.past_key_values,
                            position_ids=(mask.sum(1, keepdim=True) - 1), use_cache=True)
            conts += torch.stack(new, 1).tolist()
            ver.seen.clear()
    refs = []
    for x, c, kind in zip(ids, conts, kinds):
        ver.seen.clear()
        tokens = x + c
        with torch.inference_mode():
            model(input_ids=torch.tensor([tokens], device=device))
        aux = torch.cat([torch.cat(ver.seen[s], 0)[:, None] for s in range(len(layer_ids))], 1).flatten(1)
        refs.append({"tokens": tokens, "aux": aux.float().cpu(), "prompt_len": len(x), "kind": kind})
    ver.seen.clear()
    print(f"references: {len(refs)} prompts x {n_new} tokens in {time.time() - t0:.0f} s", flush=True)
    torch.save(refs, path)
    return refs


def measure(w, device):
    """Every epoch checkpoint of every run: acceptance length and per position at k=3 and k=5, per prompt kept for
    the noise band. Appended to W/measure.json as it goes."""
    import torch
    from eagle3pipe.measures import acceptance
    from eagle3pipe.train.checkpoints import expected_acceptance
    if not glob.glob(f"{w}/ck/*/[0-9]*/model.safetensors"):
        return {}  # no epoch saved yet: the references need a checkpoint's layer ids
    refs = references(w, device)
    refs_id = hashlib.sha256(json.dumps([r["tokens"] for r in refs]).encode()).hexdigest()[:16]
    stops = acceptance.stop_ids(MODEL)
    path = f"{w}/measure.json"
    done = json.load(open(path)) if os.path.isfile(path) else {}
    for run in sorted(os.listdir(f"{w}/ck")):
        for ep in sorted((d for d in os.listdir(f"{w}/ck/{run}") if d.isdigit()), key=int):
            key, ck = f"{run}/{ep}", f"{w}/ck/{run}/{ep}"
            if key in done or not os.path.isfile(f"{ck}/model.safetensors"):
                continue
            model, _ = acceptance.load_draft(ck, "float32", device, MODEL)
            t0, rec = time.time(), {}
            preds = [acceptance.draft_predictions(model, r["aux"], r["tokens"], K).tolist() for r in refs]
            for k in (3, 5):
                per_prompt, per_pos = [], [0] * k
                for r, pred in zip(refs, preds):
                    d, a, pos = acceptance.simulate(pred[:k], r["tokens"], r["prompt_len"], k, MAX_NEW, stops)
                    per_prompt.append([d, a])
                    per_pos = [x + y for x, y in zip(per_pos, pos)]
                drafts = sum(d for d, _ in per_prompt)
                rec[f"k{k}"] = {"acceptance_length": 1 + sum(a for _, a in per_prompt) / drafts,
                                "per_position": [x / drafts for x in per_pos], "per_prompt": per_prompt}
            vm = f"{ck}/val_metrics.json"
            rec["trainer"] = expected_acceptance(json.load(open(vm))) if os.path.isfile(vm) else None
            rec["seconds"], rec["refs"] = round(time.time() - t0, 1), refs_id
            done[key] = rec
            print(f"{key}: k=3 {rec['k3']['acceptance_length']:.4f} k=5 {rec['k5']['acceptance_length']:.4f} "
                  f"trainer {rec['trainer']} ({rec['seconds']} s)", flush=True)
            with open(path + ".tmp", "w") as f:
                json.dump(done, f)
            os.replace(path + ".tmp", path)
            del model
            torch.cuda.empty_cache() if device == "cuda" else None
    return done


def _length(per_prompt, idx):
    """Acceptance length over the prompts `idx` ([drafts, accepted] a prompt): 1 + accepted per draft."""
    return 1 + sum(per_prompt[i][1] for i in idx) / sum(per_prompt[i][0] for i in idx)


def bootstrap(per_prompt, n=2000, seed=0):
    """95% interval of the acceptance length over prompts resampled with replacement."""
    import random
    rng = random.Random(seed)
    vals = sorted(_length(per_prompt, [rng.randrange(len(per_prompt)) for _ in per_prompt]) for _ in range(n))
    return vals[int(0.025 * n)], vals[int(0.975 * n) - 1]


def paired(a, b, n=2000, seed=0):
    """B's acceptance length minus A's and its 95% interval, the same prompts resampled for both (per_prompt lists in
    one prompt order): the band for a comparison on one prompt set, narrower than either draft's own interval."""
    import random
    rng, every, diffs = random.Random(seed), range(len(a)), []
    for _ in range(n):
        idx = [rng.randrange(len(a)) for _ in a]
        diffs.append(_length(b, idx) - _length(a, idx))
    diffs.sort()
    return _length(b, every) - _length(a, every), diffs[int(0.025 * n)], diffs[int(0.975 * n) - 1]


def pooled(m, side, k="k3"):
    """One side of a comparison: RUN/EPOCH, or several '+'-joined (two seeds of one recipe) pooled prompt by prompt
    (drafts and accepted tokens summed), so the band covers both seeds. -> (per_prompt, acceptance length, refs)."""
    keys = side.split("+")
    per = [[sum(x) for x in zip(*rows)] for rows in zip(*(m[key][k]["per_prompt"] for key in keys))]
    return per, 1 + sum(a for _, a in per) / sum(d for d, _ in per), {m[key].get("refs") for key in keys}


def compare(srcs, pairs, k="k3"):
    """Paired differences between measured epochs (A:B, each side RUN/EPOCH with epochs counted from 0, or seeds
    '+'-joined and pooled) from one or more measure.json files (bench/results/scaling_quality_*.json): the 200 prompts
    are the same in every study, so epochs measured on different days pair prompt by prompt. Each measure since
    2026-12-05 names its references (a hash of the verifier's continuations); where two sides name different ones
    (another GPU's float32 kernels flipped a near-tie), the line says so."""
    m = {}
    for src in srcs:
        m.update(json.load(open(src)))
    for pair in pairs:
        a, b = pair.split(":")
        for key in (x for side in (a, b) for x in side.split("+")):
            if key not in m:
                sys.exit(f"--runs: {key!r} is in none of {', '.join(srcs)}")
        (pa, la, ra), (pb, lb, rb) = pooled(m, a, k), pooled(m, b, k)
        d, lo, hi = paired(pa, pb)
        refs = ra | rb
        note = "; references differ between runs" if len(refs - {None}) > 1 else ""
        print(f"{b} - {a}: {k} {lb:.4f} - {la:.4f} = {d:+.4f} (95%: {lo:+.4f} to {hi:+.4f}){note}", flush=True)


def best_epochs(w, k="k3"):
    m = json.load(open(f"{w}/measure.json"))
    best = {}
    for key, rec in m.items():
        run, ep = key.split("/")
        if run not in best or rec[k]["acceptance_length"] > m[f"{run}/{best[run]}"][k]["acceptance_length"]:
            best[run] = ep
    return m, best


def pack(w, runs, dst):
    """Each run's best epoch by the measure at k=3, packed for the trip back (bench_recipe.pack_one)."""
    _, best = best_epochs(w)
    for run in runs:
        pack_one(w, run, f"{w}/ck/{run}/{best[run]}", dst)


def confirm(w, runs, name, num_prompts, batch):
    """Stage 05 through vLLM on the first `num_prompts` held-out prompts (chat and code alternate), float32 so that
    its measure beside vLLM is compared in the dtype both compute in."""
    drafts = [f"{w}/ck/{r}" if "/" in r else f"{w}/ck/{r}/checkpoint_best" for r in runs]  # RUN or RUN/EPOCH
    log = f"{w}/logs/confirm_{name}.log"
    must(py("05_evaluate.py", "--config", CFG, "--draft", *drafts, "--prompts", f"{w}/heldout.jsonl",
            "--prepared-data", f"{w}/prep", "--num-prompts", str(num_prompts), "--max-new-tokens", str(MAX_NEW),
            "--num-speculative-tokens", "3", "--batch-sizes", str(batch), "--dtype", "float32", "--measure", "on",
            "--output-dir", f"{w}/confirm_{name}", log=log), "stage 05", log)


def report(w, plot):
    m, best = best_epochs(w)
    runs = {}
    for key, rec in m.items():
        run, ep = key.split("/")
        runs.setdefault(run, {})[int(ep)] = rec
    rows = ["| run | rows | epochs | best epoch (k=3) | k=3 | 95% interval | per position | k=5 | trainer's estimate |",
            "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |"]
    out = {}
    for run in sorted(runs, key=lambda r: (float("inf") if r.split("-")[0][1:] == "all" else int(r.split("-")[0][1:]),
                                            r)):
        eps, b = runs[run], m[f"{run}/{best[run]}"]
        man = json.load(open(f"{w}/ck/{run}/manifest.json")) if os.path.isfile(f"{w}/ck/{run}/manifest.json") else {}
        lo, hi = bootstrap(b["k3"]["per_prompt"])
        n_rows = (man.get("identity") or {}).get("num_samples") or run.split("-")[0][1:]
        rows.append(f"| {run} | {n_rows} | {len(eps)} | {best[run]} | "
                    f"{b['k3']['acceptance_length']:.3f} | {lo:.3f}-{hi:.3f} | "
                    f"{' / '.join(f'{x:.2f}' for x in b['k3']['per_position'])} | {b['k5']['acceptance_length']:.3f} | "
                    f"{b['trainer'] or float('nan'):.3f} |")
        out[run] = {"best_epoch": best[run], "k3": b["k3"]["acceptance_length"], "k3_interval": [lo, hi],
                    "k5": b["k5"]["acceptance_length"], "per_epoch_k3": {e: r["k3"]["acceptance_length"]
                                                                         for e, r in sorted(eps.items())},
                    "per_epoch_trainer": {e: r["trainer"] for e, r in sorted(eps.items())}}
    print("\n".join(rows))
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        for run, r in out.items():
            ep = sorted(r["per_epoch_k3"])
            ax[0].plot([e + 1 for e in ep], [r["per_epoch_k3"][e] for e in ep], marker="o", label=run)
        ax[0].set(xlabel="epoch", ylabel="acceptance length, k=3 (measure)", title="per epoch, held-out prompts")
        ax[0].legend(fontsize=7)
        plain = [r for r in out if re.fullmatch(r"n\w+-s0(-t\d+)?", r)]  # seed 0, no lever: the data curve
        sized = {}
        for r in plain:  # the best of a size's runs (tokens per step differ)
            size = r.split("-")[0]
            sized[size] = max(sized.get(size, r), r, key=lambda x: out[x]["k3"])
        sized = [(r, out[r]) for r in sized.values()]
        ax[1].errorbar([i for i, _ in enumerate(sized)], [v["k3"] for _, v in sized],
                       yerr=[[v["k3"] - v["k3_interval"][0] for _, v in sized],
                             [v["k3_interval"][1] - v["k3"] for _, v in sized]], marker="o", capsize=3, label="k=3")
        ax[1].plot([i for i, _ in enumerate(sized)], [v["k5"] for _, v in sized], marker="s", label="k=5")
        ax[1].set_xticks(range(len(sized)), [r.split("-")[0][1:] for r, _ in sized])
        ax[1].set(xlabel="training rows", ylabel="acceptance length (best epoch)", title="data")
        ax[1].legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
    result({"runs": out})


def curve(src, plot):
    """The data curve from a results file (bench/results/scaling_quality_*.json): the best epoch of each size by the
    measure (each seed) and through vLLM, on a log axis of training rows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    r = json.load(open(src))
    rows = [s["rows"] for s in r["sizes"]]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for seed in (0, 1):
        pts = [(s["rows"], s["measure"][seed]) for s in r["sizes"] if len(s["measure"]) > seed]
        ax.plot(*zip(*pts), marker="o", ls="-" if seed == 0 else "", label=f"measure, {r['prompts']['measure']} "
                f"prompts, seed {seed}")
    ax.plot(rows, [s["vllm"] for s in r["sizes"]], marker="s", label=f"vLLM, {r['prompts']['vllm']} prompts")
    k5 = [(s["rows"], s["k5"]) for s in r["sizes"] if s.get("k5")]
    if k5:
        ax.plot(*zip(*k5), marker="^", ls=":", label="measure, k=5")
    for s in r["sizes"]:
        ax.annotate(f"ep {s['best_epoch']}/{s['epochs']}", (s["rows"], s["measure"][0]), textcoords="offset points",
                    xytext=(4, -12), fontsize=7)
    ax.set_xscale("log")
    ax.set(xlabel="training conversations (rows)", ylabel=f"acceptance length (k={r['k']} unless marked)",
           title="SmolLM2-135M's EAGLE-3 draft: best epoch per data size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot, dpi=110)


STUDY = "300:10:0,300:10:1,1000:10:0,1000:10:1,3000:10:0:4096,3000:10:1:4096,10000:4:0:8192,all:3:0:8192"
# the levers at all the data (docs/RECIPE.md): the 32,768-token vocabulary, then two and three draft layers on it;
# then at 32,768 tokens a step: two and three layers, the whole vocabulary and 16,384 tokens; six and eight epochs;
# the first study's two best levers through vLLM (a Qwen3-style layer, TTT loss decay 0.8); second seeds of the
# baseline, the Qwen3-style layer and eight epochs
LEVERS = ("all:3:0:8192:v32768,all:3:1:8192:v32768,all:3:0:8192:v32768+L2,all:3:1:8192:v32768+L2,"
          "all:3:0:8192:v32768+L3,all:3:0:32768:v32768+L2,all:3:0:32768:v32768+L3,all:3:0:32768:v49152+L2,"
          "all:3:0:32768:v16384+L2,all:6:0:32768:v32768+L2+e6,all:8:0:32768:v32768+L2+e8,"
          "all:3:0:32768:v32768+L2+qwen3-layer,all:3:0:32768:v32768+L2+decay0.8,all:3:1:32768:v32768+L2,"
          "all:3:1:32768:v32768+L2+qwen3-layer,all:8:1:32768:v32768+L2+e8")


def study(w, states, parallel, plot):
    """The whole study in one command, on one machine with a GPU and vLLM: every step above in order (each skips what
    W already holds), the best draft of each size confirmed through vLLM, the table and the plot."""
    prepare(w, 1000, 100, [16384, 32768, 49152])
    extract(w, states)
    train(w, states, STUDY.split(",") + LEVERS.split(","), parallel, [])
    import torch
    measure(w, "cuda" if torch.cuda.is_available() else "cpu")
    m, best = best_epochs(w)
    sizes = {}
    for run in best:  # the best run of each size, seed 0 and no lever: the data curve's drafts
        if re.fullmatch(r"n\w+-s0(-t\d+)?", run):
            size = run.split("-")[0]
            if size not in sizes or m[f"{run}/{best[run]}"]["k3"]["acceptance_length"] > \
                    m[f"{sizes[size]}/{best[sizes[size]]}"]["k3"]["acceptance_length"]:
                sizes[size] = run
    confirm(w, sorted(f"{run}/{best[run]}" for run in sizes.values()), "sizes", 100, 1)  # each size's best epoch
    levers = [run for run in best if re.fullmatch(r"nall-s\d+-t\d+-v\d+(-L\d+)?", run)]
    if levers:  # the winner at all the data, beside the baseline's best epoch
        win = max(levers, key=lambda r: m[f"{r}/{best[r]}"]["k3"]["acceptance_length"])
        confirm(w, [f"{win}/{best[win]}", f"{sizes['nall']}/{best[sizes['nall']]}"] if "nall" in sizes
                else [f"{win}/{best[win]}"], "winner", 100, 1)
    report(w, plot)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=["prepare", "carry", "uncarry", "extract", "check", "train", "measure", "pack", "unpack",
                                    "confirm", "report", "curve", "compare", "study"])
    p.add_argument("--work", required=True)
    p.add_argument("--states", default=None, help="stage 02's folder (default: W/hs)")
    p.add_argument("--holdout", type=int, default=500, help="the package's last N records, never trained on")
    p.add_argument("--prompts-per-kind", type=int, default=100)
    p.add_argument("--vocab", default="", help="prepare: draft vocabulary sizes for the v<n> lever, comma-separated")
    p.add_argument("--runs", default="", help="train: SIZE:EPOCHS:SEED,...; pack/confirm: run names")
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--extra", default="", help="flags every training run gets")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default="")
    p.add_argument("--src", default="")
    p.add_argument("--name", default="final")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--plot", default="")
    p.add_argument("--k", type=int, choices=(3, 5), default=3, help="compare: speculative tokens per round")
    p.add_argument("--watch", type=int, default=0, help="measure: keep measuring new epochs while train runs, S s")
    a = p.parse_args()
    w = os.path.abspath(a.work)
    os.makedirs(f"{w}/logs", exist_ok=True)
    states = os.path.abspath(a.states or f"{w}/hs")
    runs = [r for r in a.runs.split(",") if r]
    if a.step == "prepare":
        prepare(w, a.holdout, a.prompts_per_kind, [int(v) for v in a.vocab.split(",") if v])
    elif a.step == "carry":
        carry(w, a.out)
    elif a.step == "uncarry":
        uncarry(w, a.src)
    elif a.step == "extract":
        extract(w, states)
    elif a.step == "check":
        check(w, states, runs, a.extra.split())
    elif a.step == "train":
        train(w, states, runs, a.parallel, a.extra.split())
    elif a.step == "measure":
        import torch
        device, deadline = a.device or ("cuda" if torch.cuda.is_available() else "cpu"), time.time() + a.watch
        measure(w, device)
        while time.time() < deadline and os.path.exists(f"{w}/training"):
            time.sleep(15)
            measure(w, device)
    elif a.step == "pack":
        pack(w, runs, a.out)
    elif a.step == "unpack":
        unpack(w, a.src)
    elif a.step == "confirm":
        confirm(w, runs, a.name, a.num_prompts, a.batch_size)
    elif a.step == "curve":
        curve(a.src, a.plot)
    elif a.step == "compare":
        compare(a.src.split(","), runs, f"k{a.k}")
    elif a.step == "study":
        study(w, states, a.parallel, a.plot or f"{w}/scaling_quality.png")
    else:
        report(w, a.plot)


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
