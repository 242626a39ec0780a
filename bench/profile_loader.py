"""Where a data-loader worker's time goes, per sample, at Kimi-K2.5's width (issue 35: stage 04 waited on data 30 %
of the time on one H200). Each step of CheckedFiles.get_cached (eagle3pipe/train/train_data.py) timed apart on real stage
02 files written by hidden_states.save: the read (page cache), the CRC-32, safetensors' parse, the finite check,
fp8's dequantization; then the whole get_cached as the trainer calls it. One process, one thread, like one worker.

    python -m bench.profile_loader [--tokens 2048] [--hidden 7168] [--states 4] [--reps 5]

The implied rate is tokens a second per worker: the trainer's rate divided by it is how many workers keep it fed.
"""
import argparse
import json
import os
import tempfile
import time
import zlib


def timed(fn, reps):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--states", type=int, default=4, help="auxiliary layers + the last layer")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    import numpy as np
    import torch
    from safetensors.torch import load as load_bytes
    from eagle3pipe.formats import hidden_states as hs
    from eagle3pipe.train.train_data import CheckedFiles
    torch.set_num_threads(1)  # one loader worker
    print(f"torch {torch.__version__}, {a.tokens} tokens x {a.states} states x {a.hidden} per sample, one thread, "
          f"best of {a.reps}")
    g = torch.Generator().manual_seed(0)
    states = torch.randn(a.tokens, a.states, a.hidden, generator=g).to(torch.bfloat16)
    ids = torch.arange(a.tokens, dtype=torch.int64)
    result = {}
    with tempfile.TemporaryDirectory() as d:
        for storage in ("bf16", "fp8"):
            t = {"hidden_states": states, "token_ids": ids}
            if storage == "fp8":
                q, scale = hs.quantize_fp8(states)
                t = {"hidden_states": q, hs.SCALES: scale, "token_ids": ids}
            path = hs.hs_path(d, 0 if storage == "bf16" else 1)
            hs.save(path, t)
            size = os.path.getsize(path)
            header, start, _ = hs.read_header(path)
            with open(path, "rb") as f:
                f.read()  # in the page cache, as a re-read epoch finds it
            steps = {}
            steps["read"], data = timed(lambda: open(path, "rb").read(), a.reps)
            steps["crc32"], _ = timed(lambda: zlib.crc32(memoryview(data)[start:]), a.reps)
            steps["before: safetensors load (a copy)"], got = timed(lambda: load_bytes(data), a.reps)
            whole = np.frombuffer(bytearray(data), dtype=np.uint8)  # what load_sample reads into (no copy of its own)
            steps["now: views of the read buffer"], _ = timed(lambda: hs._views(whole, start, header), a.reps)
            key = hs.SCALES if storage == "fp8" else "hidden_states"
            steps["before: isfinite(x).all()"], _ = timed(lambda: torch.isfinite(got[key]).all(), a.reps)
            steps["now: aminmax"], _ = timed(lambda: hs.finite(got[key]), a.reps)
            if storage == "fp8":
                from hs_connectors.fp8_utils import dequantize_fp8_tensor
                steps["before: fp8 -> bf16 (speculators')"], _ = timed(
                    lambda: dequantize_fp8_tensor(got["hidden_states"], got[hs.SCALES], dtype=torch.bfloat16), a.reps)
                steps["then: fp8 -> bf16 (table)"], _ = timed(
                    lambda: hs.fp8_to(got["hidden_states"], got[hs.SCALES], torch.bfloat16), a.reps)
                from eagle3pipe.formats import fp8_transport  # stage 04 now: bytes on, dequantized on the GPU
                steps["now: fp8 bytes + scales packed"], _ = timed(
                    lambda: fp8_transport.pack(got["hidden_states"], got[hs.SCALES]), a.reps)
            steps["load_sample (all checks)"], _ = timed(lambda: hs.load_sample(path, a.states, a.hidden), a.reps)
            cf = CheckedFiles(d, a.states, a.hidden, os.path.join(d, "skipped.jsonl"), rows=2)
            steps["get_cached (what a worker did)" if storage == "fp8" else "get_cached (what a worker does)"], _ = \
                timed(lambda: cf.get_cached(0 if storage == "bf16" else 1), a.reps)
            if storage == "fp8":  # stage 04 reads an fp8 folder with packed=True (fp8_transport.py)
                cf = CheckedFiles(d, a.states, a.hidden, os.path.join(d, "skipped.jsonl"), rows=2, packed=True)
                steps["get_cached (what a worker does)"], _ = timed(lambda: cf.get_cached(1), a.reps)
            print(f"\n{storage}: {size / 1e6:.1f} MB a sample")
            print(f"  {'step':38s} {'ms':>8s} {'GB/s':>7s} {'k tok/s':>8s}")
            for name, s in steps.items():
                print(f"  {name:38s} {s * 1e3:8.1f} {size / s / 1e9:7.2f} {a.tokens / s / 1e3:8.1f}")
            result[storage] = {name: round(s * 1e3, 1) for name, s in steps.items()}
    print("RESULT " + json.dumps({"ms_per_sample": result, "tokens": a.tokens, "hidden": a.hidden,
                                  "states": a.states}))


if __name__ == "__main__":
    main()
