"""Diagnosis: where stage 02's HF backend loses time against a bare forward on one NVIDIA GPU (issue 15's shallow
slice: a 4-layer DeepSeek-V3 at Kimi's width measured 0.79x). The same batches, in one process, through:

  bare          AutoModel with no hooks
  forward       HFBackend.forward (hooks, stack, finiteness check, pinned copy on a side stream), nothing written
  writers:D:N[:V]  + the real Writer with N threads writing to D: `disk` (--work, as stage 02 runs) or `shm`
                (/dev/shm: no disk, no writeback); V: `noop` (the file write skipped: the queue, the event waits, the
                checks), `nocrc` (the CRC skipped), `oldsave` (the save before issue 15's change), `fp8` (storage),
                `spin` (copy events that waiting threads spin on, as before issue 15); several joined by `+`

Each mode runs every batch once untimed, then once timed; then 10 middle batches under torch.profiler: the GPU's
kernel time against the wall time (idle GPU = the host is the limit), device-to-host copy time, host-side calls.

    python bench/diag_extract_gpu.py --assets .gpu --work /tmp/d [--layers 4] [--modes bare,forward,...]
"""
import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_extract_gpu import batch_tensors  # noqa: E402
from bench_kimi_gpu import REPO, make_verifier, run  # noqa: E402

sys.path.insert(0, REPO)


def make_step(mode, model_path, rows, layer_ids, work, hidden, n_states):
    """-> (step(batch), finish(), cleanup()) for one mode."""
    import torch
    from eagle3pipe import extraction
    if mode == "bare":
        from transformers import AutoModel
        model = AutoModel.from_pretrained(model_path, dtype=torch.bfloat16, device_map={"": "cuda"}).eval()

        def step(b):
            ids, mask = batch_tensors(rows, b)
            with torch.inference_mode():
                model(input_ids=ids.cuda(non_blocking=True), attention_mask=mask.cuda(non_blocking=True), use_cache=False)
        return step, torch.cuda.synchronize, lambda: None, model
    from eagle3pipe.backends import HFBackend
    backend = HFBackend(model_path, layer_ids)
    if mode == "forward":
        prev = []

        def step(b):
            results = backend.forward([(i, rows[i]) for i in b])
            for r in prev:
                r.event.synchronize()
            prev[:] = results.values()

        def finish():
            for r in prev:
                r.event.synchronize()
            torch.cuda.synchronize()
        return step, finish, lambda: None, backend.model
    # writers:<dest>:<threads>[:variant]; dest disk|shm; variant noop (no file write), nocrc (CRC skipped),
    # oldsave (CRC over the whole sample, then the write: the save before issue 15), fp8
    _, dest, threads, *variant = mode.split(":") + [""]
    variant = set(variant[0].split("+"))
    if "spin" in variant:  # the copy events as before issue 15: waiting threads spin in the driver
        real_event = torch.cuda.Event
        torch.cuda.Event = lambda blocking=False, **kw: real_event(**kw)
    out = f"{work}/hs_diag" if dest == "disk" else "/dev/shm/hs_diag"
    os.makedirs(out, exist_ok=True)
    from eagle3pipe import hidden_states
    real_save, real_zlib = extraction.save, hidden_states.zlib
    if "noop" in variant:
        extraction.save = lambda path, tensors: None
    elif "oldsave" in variant:
        extraction.save = old_save
    if "nocrc" in variant:
        hidden_states.zlib = type("NoCRC", (), {"crc32": staticmethod(lambda data, crc=0: 0)})
    writer = [extraction.Writer(out, rows, n_states, hidden, lambda i, reason: None, threads=int(threads), depth=16,
                                storage="fp8" if "fp8" in variant else "bf16")]
    if "fp8" in variant:
        backend.storage = "fp8"

    def step(b):
        results = backend.forward([(i, rows[i]) for i in b])
        for i in b:
            writer[0].put(i, results[i])

    def finish():
        writer[0].q.join()
        torch.cuda.synchronize()

    def cleanup():
        writer[0].close()
        extraction.save, hidden_states.zlib = real_save, real_zlib
        if "spin" in variant:
            torch.cuda.Event = real_event
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
    return step, finish, cleanup, backend.model


def old_save(path, tensors):
    """stage 02's save before issue 15's change: the CRC over each whole tensor, then the writes."""
    import struct
    import zlib
    import torch
    from eagle3pipe.files import atomic_path
    from eagle3pipe.hidden_states import _ST_DTYPES
    header, views, offset, crc = {}, [], 0, 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        mv = memoryview(t.view(-1).view(torch.uint8).numpy())
        header[name] = {"dtype": _ST_DTYPES[str(t.dtype)], "shape": list(t.shape), "data_offsets": [offset, offset + len(mv)]}
        offset += len(mv)
        crc = zlib.crc32(mv, crc)
        views.append(mv)
    header["__metadata__"] = {"format": "pt", "crc32": f"{crc:08x}"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for mv in views:
                f.write(mv)


def host_speeds():
    """GB/s of one thread: zlib's CRC-32, a memory copy, a write to /dev/shm (72 MB: one sample at this width)."""
    import zlib
    import numpy as np
    b = np.random.default_rng(0).bytes(72 << 20)
    r = {}
    for name, fn in (("crc32", lambda: zlib.crc32(b)), ("memcpy", lambda: bytearray(b)),
                     ("shm_write", lambda: open("/dev/shm/speed", "wb").write(b))):
        fn()
        t0 = time.time()
        for _ in range(3):
            fn()
        r[name] = round(3 * 72 / 1024 / (time.time() - t0), 2)
    os.remove("/dev/shm/speed")
    r["zlib"] = zlib.ZLIB_RUNTIME_VERSION
    return r


def profile(step, finish, batches):
    import torch
    from torch.profiler import ProfilerActivity, profile as prof
    finish()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.time()
        for b in batches:
            step(b)
        finish()
        wall = time.time() - t0
    from torch.autograd import DeviceType
    kernels = memcpy = 0.0
    host = {}
    for e in p.events():
        us = e.time_range.end - e.time_range.start
        if e.device_type == DeviceType.CUDA:
            if "memcpy" in e.name.lower():
                memcpy += us
            else:
                kernels += us
        elif e.name.startswith("cuda") and e.name[4:5].isupper():  # CUDA runtime calls on the host
            c = host.setdefault(e.name, [0, 0.0])
            c[0] += 1
            c[1] += us / 1e3
    top = sorted(host.items(), key=lambda kv: -kv[1][1])[:8]
    return {"wall_s": round(wall, 3), "gpu_kernel_s": round(kernels / 1e6, 3), "gpu_busy": round(kernels / 1e6 / wall, 3),
            "memcpy_s": round(memcpy / 1e6, 3), "host_calls_ms": {k: [n, round(ms, 1)] for k, (n, ms) in top}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--assets", required=True)
    ap.add_argument("--work", default="/tmp/d")
    ap.add_argument("--num-samples", type=int, default=250)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--modes", default="bare,forward,writers:shm:4:noop,writers:shm:4,writers:disk:4")
    a = ap.parse_args()
    import torch
    from eagle3pipe.extraction import make_batches
    os.makedirs(a.work, exist_ok=True)
    model, prep = f"{a.work}/v{a.layers}", f"{a.work}/prep"
    make_verifier(a.assets, model, a.layers, 16, 8)
    run([sys.executable, "01_prepare_dataset.py", "--model-path", model, "--dataset", f"{a.assets}/train.json",
         "--num-samples", str(a.num_samples), "--max-seq-len", "2048", "--output-dir", prep], f"{a.work}/01.log")
    rows = [json.loads(line)["input_ids"] for line in open(f"{prep}/tokenized_data.jsonl")]
    tokens = sum(map(len, rows))
    cfg = json.load(open(f"{model}/config.json"))
    layer_ids = [1, 2, 3, a.layers] if a.layers < 7 else [2, a.layers // 2, a.layers - 3, a.layers]
    batches = make_batches(range(len(rows)), [len(r) for r in rows], 8)
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "tokens": tokens, "batches": len(batches),
           "cpus": os.cpu_count(), "host": host_speeds()}
    print("host", json.dumps(res["host"]), flush=True)
    for mode in a.modes.split(","):
        step, finish, cleanup, m = make_step(mode, model, rows, layer_ids, a.work, cfg["hidden_size"], len(layer_ids))
        r = {"experts": getattr(m.config, "_experts_implementation", None), "attn": m.config._attn_implementation}
        for b in batches:  # untimed: kernels tuned per shape, pinned buffers and allocator pools filled
            step(b)
        finish()
        t0 = time.time()
        for b in batches:
            step(b)
        finish()
        r["tok_s"] = round(tokens / (time.time() - t0), 1)
        mid = len(batches) // 2
        r["profile_10"] = profile(step, finish, batches[mid - 5: mid + 5])
        cleanup()
        del step, finish, m
        torch.cuda.empty_cache()
        res[mode] = r
        print(mode, json.dumps(r), flush=True)
    for mode in a.modes.split(","):
        if mode != "bare" and "bare" in res:
            res[mode]["ratio"] = round(res[mode]["tok_s"] / res["bare"]["tok_s"], 3)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
