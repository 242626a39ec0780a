"""Benchmark: stage 04 at Kimi-K2.5's width on one NVIDIA GPU, the MLA draft (`--draft-arch deepseek`) against the
Llama-style draft (`--draft-arch llama`), same data, steps and flags: training tokens/s (the median of the dense
log's per-step rates after warm-up) and peak GPU memory (nvidia-smi, polled every 0.2 s), each in its own process.

    python -m bench.bench_mla_draft_gpu --assets .gpu --work /tmp/m [--num-samples 120] [--steps 40] [--arms llama]

A call's time limit can split the two arms (`--arms llama`, then `--arms deepseek` on the same machine: the data is
made once and each arm's result is kept in the work folder); the ratio comes once both are there.

A random DeepSeek-V3 at Kimi's width (hidden 7168, 64 heads, MLA latent 512; 4 layers, so aux ids 1,2,3) makes the
hidden states (stage 02, HF backend); its weights are random: this measures speed and memory, not quality.
--assets: SmolLM2's tokenizer files and config.json (the vocabulary) and train.json (ShareGPT). One RESULT line.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

from bench.common import REPO, deepseek_v3, result, run, stage02, wait


def peak_memory_mib(proc, every=0.2):
    """The highest GPU memory in use (MiB, nvidia-smi) while `proc` runs."""
    peak = [0]

    def poll():
        while proc.poll() is None:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.split()
            if out:
                peak[0] = max(peak[0], int(out[0]))
            time.sleep(every)
    t = threading.Thread(target=poll, daemon=True)
    t.start()
    return t, peak


def train(a, arch, model, prep, hs, vocab):
    out = f"{a.work}/ckpt_{arch}"
    cmd = [sys.executable, "04_train.py", "--model-path", model, "--prepared-data", prep, "--hidden-states", hs,
           "--vocab-mapping", vocab, "--output-dir", out, "--epochs", "1", "--max-steps", str(a.steps),
           "--log-every", "1", "--draft-arch", arch, "--loss-implementation", "eager", "--total-seq-len", "8192"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    thread, peak = peak_memory_mib(proc)
    text = proc.communicate()[0]
    thread.join()
    open(f"{a.out}/train_{arch}.log", "w").write(text)
    rates = [float(x.replace(",", "")) for x in re.findall(r"step \d+/\d+ .* ([0-9,]+) tok/s", text)]
    steady = rates[len(rates) // 4:]  # the first quarter pays compilation
    return {"returncode": proc.returncode, "wall_s": round(time.time() - t0, 1), "steps_logged": len(rates),
            "median_tok_s": round(statistics.median(steady), 1) if steady else None, "peak_gpu_mib": peak[0],
            "tail": text.strip().splitlines()[-3:] if proc.returncode else []}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--assets", required=True)
    ap.add_argument("--work", default="/tmp/m")
    ap.add_argument("--out", default=".")
    ap.add_argument("--num-samples", type=int, default=120)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--arms", default="llama,deepseek")
    a = ap.parse_args()
    import torch
    os.makedirs(a.work, exist_ok=True)
    py, w = sys.executable, a.work
    model, prep, hs, vocab = f"{w}/verifier", f"{w}/prep", f"{w}/hs", f"{w}/vocab"
    if not os.path.isfile(f"{vocab}/manifest.json"):
        deepseek_v3(a.assets, model, 4, 16, 8)
        run([py, "01_prepare_dataset.py", "--model-path", model, "--dataset", f"{a.assets}/train.json",
             "--num-samples", str(a.num_samples), "--max-seq-len", "2048", "--output-dir", prep], f"{a.out}/m_01.log")
        wait(stage02(model, prep, hs, "--batch-size", "8", "--layer-ids", "1,2,3"), "stage 02")
        run([py, "03_build_vocab_mapping.py", "--prepared-data", prep, "--draft-vocab-size", "32000", "--output-dir",
             vocab], f"{a.out}/m_03.log")
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": a.steps}
    for arch in ("llama", "deepseek"):
        kept = f"{w}/result_{arch}.json"
        if arch in a.arms.split(","):
            res[arch] = train(a, arch, model, prep, hs, vocab)
            json.dump(res[arch], open(kept, "w"))
            print(f"{arch}: {json.dumps(res[arch])}", flush=True)
        elif os.path.isfile(kept):
            res[arch] = json.load(open(kept))
    if "llama" not in res or "deepseek" not in res:
        result(res)
        return
    if res["llama"]["median_tok_s"] and res["deepseek"]["median_tok_s"]:
        res["tok_s_ratio_mla_to_llama"] = round(res["deepseek"]["median_tok_s"] / res["llama"]["median_tok_s"], 3)
        res["memory_ratio_mla_to_llama"] = round(res["deepseek"]["peak_gpu_mib"] / res["llama"]["peak_gpu_mib"], 3)
    result(res)


if __name__ == "__main__":
    main()
