"""Benchmark: stage 01's rows as stages 02 and 04 hold them (eagle3pipe/storage/rows.py, one int32 and one uint8 array)
against the Python lists they replaced, on all the embedded conversations; and stage 04's Arrow table built from
each. Every case runs in its own process, alternated (lists, arrays, ...), timed and measured by its peak resident
memory (ru_maxrss); a process that only imports the same libraries gives the floor both stand on.

    python -m bench.bench_read_rows [--prepared DIR] [--reps 2]

Without --prepared, stage 01 first prepares all the embedded conversations into a temporary folder (about a minute
on two cores). Prints one RESULT line (JSON): each run, the medians, and the arrays' ratios against the lists.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench.common import REPO, result, run

MODEL = os.path.join(REPO, "data", "models", "smollm2-135m-instruct")

# one process per case; `lists` is the reader as it was before rows.py: json per line, ids and masks kept as lists,
# the same checks per element
CASE = r"""
import json, os, resource, sys, time
sys.path.insert(0, {repo!r})
import numpy, datasets
from eagle3pipe.storage.rows import read_rows
folder, case, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
t = time.perf_counter()
if case.startswith("lists"):
    rows = []
    with open(os.path.join(folder, "tokenized_data.jsonl"), "rb") as f:
        for line in f:
            r = json.loads(line)
            ids, mask = r["input_ids"], r["loss_mask"]
            assert all(type(x) is int for x in ids) and all(x in (0, 1) for x in mask) and len(ids) == len(mask)
            rows.append((ids, mask))
elif case.startswith("arrays"):
    rows = read_rows(folder, n)
read = time.perf_counter() - t
t = time.perf_counter()
if case == "lists+table":
    datasets.Dataset.from_dict({{"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows],
                                "seq_len": [len(r[0]) for r in rows]}}).save_to_disk(sys.argv[4])
elif case == "arrays+table":
    from eagle3pipe.train import train_data
    train_data.build_bridge(rows, sys.argv[4])
table = time.perf_counter() - t
print(json.dumps({{"read_s": round(read, 2), "table_s": round(table, 2),
                  "maxrss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3)}}))
"""


def once(work, folder, rows, case, rep):
    out = os.path.join(work, f"{case}-{rep}")
    p = subprocess.run([sys.executable, "-c", CASE.format(repo=REPO), folder, case, str(rows), out],
                       capture_output=True, text=True, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
    return {"case": case, **json.loads(p.stdout.strip().splitlines()[-1])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepared", help="a stage 01 folder (default: prepare all the embedded conversations)")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-rows-") as work:
        folder = a.prepared
        if folder is None:
            folder = os.path.join(work, "prepared")
            run([sys.executable, "01_prepare_dataset.py", "--model-path", MODEL, "--output-dir", folder],
                os.path.join(work, "prepare.log"))
        manifest = json.load(open(os.path.join(folder, "manifest.json")))
        rows, tokens = manifest["counts"]["rows"], manifest["counts"]["tokens"]
        runs = [once(work, folder, rows, "floor", 0)]
        for rep in range(a.reps):
            for case in ("lists", "arrays", "lists+table", "arrays+table"):
                runs.append(once(work, folder, rows, case, rep))
                print(runs[-1], flush=True)
    med = {c: {k: statistics.median(r[k] for r in runs if r["case"] == c) for k in ("read_s", "table_s", "maxrss_gb")}
           for c in ("floor", "lists", "arrays", "lists+table", "arrays+table")}
    floor = med["floor"]["maxrss_gb"]
    above = {c: round(med[c]["maxrss_gb"] - floor, 3) for c in med if c != "floor"}
    result({"rows": rows, "tokens": tokens, "runs": runs, "median": med, "above_floor_gb": above,
            "bytes_per_token_above_floor": {c: round(v * 1e9 / tokens, 1) for c, v in above.items()},
            "read_speedup": round(med["lists"]["read_s"] / med["arrays"]["read_s"], 2),
            "table_speedup": round(med["lists+table"]["table_s"] / med["arrays+table"]["table_s"], 2)})


if __name__ == "__main__":
    main()
