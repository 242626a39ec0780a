"""Diagnosis: where stage 02's HF backend loses time against a bare forward on one NVIDIA GPU (issue 15's shallow
slice: a 4-layer DeepSeek-V3 at Kimi's width measured 0.79x). The same batches, in one process, through:

  bare          AutoModel with no hooks
  forward       HFBackend.forward (hooks, stack, finiteness check, pinned copy on a side stream queued after the
                next batch's model call), nothing written
  writers:D:N[:V]  + the real Writer with N threads writing to D: `disk` (--work, as stage 02 runs) or `shm`
                (/dev/shm: no disk, no writeback); V: `noop` (the file write skipped: the queue, the event waits, the
                checks), `nocrc` (the CRC skipped), `oldsave` (the save before issue 15's change), `fp8` (storage),
                `spin` (copy events that waiting threads spin on, as before issue 15); several joined by `+`
  bare:pinned   the inputs copied from pinned host memory (no wait before the copy; no gain measured)
  forward:nocopy   the states left on the GPU (no device-to-host copy)
  forward:immediate, writers:...:immediate   each batch's copy queued right after its own forward (before issue 15's
                change: the copy then delayed the next batch's model at its host syncs)

Each mode runs every batch twice, both timed (the first pass of the process's first mode meets every batch shape
for the first time, as stage 02 does); then 10 middle batches under torch.profiler: the GPU's
kernel time against the wall time (idle GPU = the host is the limit), device-to-host copy time, host-side calls,
the attention kernel, and each idle gap over 0.1 ms charged to the host call running at its middle. --check first
compares 6 batches' host tensors, copies queued late (the default) against at once: they must be identical.

    python -m bench.diag_extract_gpu --assets .gpu --work /tmp/d [--layers 4] [--modes bare,forward,...] [--sdpa nocudnn] [--check]
"""
import argparse
import json
import os
import shutil
import sys
import time

from bench.common import batch_tensors, deepseek_v3, result, run


def make_step(mode, model_path, rows, layer_ids, work, hidden, n_states):
    """-> (step(batch), finish(), cleanup()) for one mode."""
    import torch
    from eagle3pipe.extract import extraction
    if mode.startswith("bare"):  # bare:pinned: the inputs copied from pinned memory (no sync before the copy)
        from transformers import AutoModel
        model = AutoModel.from_pretrained(model_path, dtype=torch.bfloat16, device_map={"": "cuda"}).eval()

        def step(b):
            ids, mask = batch_tensors(rows, b)
            if mode == "bare:pinned":
                ids, mask = ids.pin_memory(), mask.pin_memory()
            with torch.inference_mode():
                model(input_ids=ids.cuda(non_blocking=True), attention_mask=mask.cuda(non_blocking=True), use_cache=False)
        return step, torch.cuda.synchronize, lambda: None, model
    from eagle3pipe.engines.backends import HFBackend
    backend = HFBackend(model_path, layer_ids)
    if mode == "forward:nocopy":  # the states stay on the GPU: no device-to-host copy at all
        backend._hold = lambda out: (out, None)
    if mode.endswith(":immediate"):  # each batch's copy queued right after its forward, as before issue 15's change
        real_forward, mode = backend.forward, mode[: -len(":immediate")]

        def forward(batch):
            results = real_forward(batch)
            backend.flush()
            return results
        backend.forward = forward
    if mode in ("forward", "forward:nocopy"):
        prev = []

        def step(b):
            results = backend.forward([(i, rows[i]) for i in b])
            for r in prev:
                if r.event is not None:
                    r.event.synchronize()
            prev[:] = results.values()

        def finish():
            backend.flush()
            for r in prev:
                if r.event is not None:
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
    from eagle3pipe.formats import hidden_states
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
        backend.flush()
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
    from eagle3pipe.storage.files import atomic_path
    from eagle3pipe.formats.hidden_states import _ST_DTYPES
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


def check_deferred(model_path, rows, batches, layer_ids):
    """The host tensors of 6 batches with each copy queued late (the default: at the next forward / flush) against
    queued at once: identical bytes, or the largest difference."""
    import torch
    from eagle3pipe.engines.backends import HFBackend
    backend = HFBackend(model_path, layer_ids)

    def collect(at_once):
        got = {}
        for b in batches[:6]:
            got.update(backend.forward([(i, rows[i]) for i in b]))
            if at_once:
                backend.flush()
        backend.flush()
        for r in got.values():
            r.event.synchronize()
        return {i: ({k: v.clone() for k, v in r.tensors.items()}, bool(r.bad)) for i, r in got.items()}
    late, now = collect(False), collect(True)
    diff = max((late[i][0][k].float() - now[i][0][k].float()).abs().max().item() for i in now for k in now[i][0])
    return {"rows": len(now), "identical": all(torch.equal(late[i][0][k], now[i][0][k]) for i in now for k in now[i][0])
            and all(late[i][1] == now[i][1] for i in now), "max_abs_diff": diff}


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


LABELS = ("model", "step")  # record_function regions; the profiler mirrors them on the GPU's timeline too


def idle_gaps(p, min_us=100):
    """The GPU's idle gaps over `min_us` (no kernel on any stream), each charged to the host's innermost labelled
    region (record_function: `model`, `step`) and CPU op running at the gap's middle: where the host held the GPU up."""
    from torch.autograd import DeviceType
    kern = sorted((e.time_range.start, e.time_range.end) for e in p.events()
                  if e.device_type == DeviceType.CUDA and "memcpy" not in e.name.lower() and e.name not in LABELS)
    cpu = sorted(((e.time_range.start, e.time_range.end, e.name) for e in p.events() if e.device_type == DeviceType.CPU))
    if not kern:
        return {}
    by, end = {}, kern[0][1]
    for a, b in kern[1:]:
        if a - end > min_us:
            mid = (a + end) / 2
            on = [n for s0, s1, n in cpu if s0 <= mid <= s1]
            labels = [n for n in on if n in LABELS]
            key = f"{labels[-1] if labels else '-'} | {on[-1][:40] if on else '-'}"
            c = by.setdefault(key, [0, 0.0])
            c[0] += 1
            c[1] += (a - end) / 1e3
        end = max(end, b)
    return {k: [n, round(ms, 1)] for k, (n, ms) in sorted(by.items(), key=lambda kv: -kv[1][1])[:8]}


def profile(step, finish, batches, model=None):
    from torch.profiler import ProfilerActivity, profile as prof, record_function
    finish()
    hook = None
    if model is not None:  # label the model's forward, to charge each idle gap to the model or to our code
        ctx = []
        pre = model.register_forward_pre_hook(lambda *_: ctx.append(record_function("model").__enter__()))
        post = model.register_forward_hook(lambda *_: ctx.pop().__exit__(None, None, None))
        hook = (pre, post)
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.time()
        for b in batches:
            with record_function("step"):
                step(b)
        finish()
        wall = time.time() - t0
    for h in hook or ():
        h.remove()
    from torch.autograd import DeviceType
    kernels = memcpy = 0.0
    host = {}
    cpu_ops = sorted((e.time_range.start, e.time_range.end, e.name) for e in p.events() if e.device_type == DeviceType.CPU)
    for e in p.events():
        us = e.time_range.end - e.time_range.start
        if e.device_type == DeviceType.CUDA and e.name not in LABELS:
            if "memcpy" in e.name.lower():
                memcpy += us
            else:
                kernels += us
        elif e.name.startswith("cuda") and e.name[4:5].isupper():  # CUDA runtime calls on the host
            c = host.setdefault(e.name, [0, 0.0])
            c[0] += 1
            c[1] += us / 1e3
    top = sorted(host.items(), key=lambda kv: -kv[1][1])[:8]
    ops = sorted((e for e in p.key_averages() if e.device_type == DeviceType.CPU), key=lambda e: -e.self_cpu_time_total)
    attn = sorted({e.name[:60] for e in p.events() if e.device_type == DeviceType.CUDA
                   and any(w in e.name.lower() for w in ("fmha", "flash", "attention", "cudnn", "sdpa"))})
    sync_at = {}
    for s0, s1, name in sorted(((e.time_range.start, e.time_range.end, e.name) for e in p.events()
                                if e.device_type == DeviceType.CPU)):
        if name in ("cudaStreamSynchronize", "cudaMemcpyAsync"):
            outer = [n for a, b, n in cpu_ops if a <= s0 and s1 <= b and n.startswith("aten::")]
            key = f"{name} in {' > '.join(outer[-2:])}"
            sync_at[key] = sync_at.get(key, 0) + 1
    return {"sync_and_copy_sites": dict(sorted(sync_at.items(), key=lambda kv: -kv[1])[:10]),
            "wall_s": round(wall, 3), "gpu_kernel_s": round(kernels / 1e6, 3), "gpu_busy": round(kernels / 1e6 / wall, 3),
            "memcpy_s": round(memcpy / 1e6, 3), "host_calls_ms": {k: [n, round(ms, 1)] for k, (n, ms) in top},
            "host_self_ms": {e.key[:40]: [e.count, round(e.self_cpu_time_total / 1e3, 1)] for e in ops[:10]},
            "attention_kernels": attn[:4], "idle_gaps_ms": idle_gaps(p)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--assets", required=True)
    ap.add_argument("--work", default="/tmp/d")
    ap.add_argument("--num-samples", type=int, default=250)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--modes", default="bare,forward,writers:shm:4:noop,writers:shm:4,writers:disk:4")
    ap.add_argument("--sdpa", default="default", choices=["default", "nocudnn", "efficient", "flash", "cudnn", "math"],
                    help="torch SDPA backends allowed in this process (nocudnn: all but cuDNN's, which plans per shape)")
    ap.add_argument("--check", action="store_true", help="first compare deferred against immediate host copies")
    a = ap.parse_args()
    import torch
    if a.sdpa != "default":
        b = torch.backends.cuda
        for name, enable in (("cudnn", b.enable_cudnn_sdp), ("efficient", b.enable_mem_efficient_sdp),
                             ("flash", b.enable_flash_sdp), ("math", b.enable_math_sdp)):
            enable(name != "cudnn" if a.sdpa == "nocudnn" else name == a.sdpa)
    from eagle3pipe.extract.extraction import make_batches
    os.makedirs(a.work, exist_ok=True)
    model, prep = f"{a.work}/v{a.layers}", f"{a.work}/prep"
    deepseek_v3(a.assets, model, a.layers, 16, 8)
    run([sys.executable, "01_prepare_dataset.py", "--model-path", model, "--dataset", f"{a.assets}/train.json",
         "--num-samples", str(a.num_samples), "--max-seq-len", "2048", "--output-dir", prep], f"{a.work}/01.log")
    rows = [json.loads(line)["input_ids"] for line in open(f"{prep}/tokenized_data.jsonl")]
    tokens = sum(map(len, rows))
    cfg = json.load(open(f"{model}/config.json"))
    layer_ids = [1, 2, 3, a.layers] if a.layers < 7 else [2, a.layers // 2, a.layers - 3, a.layers]
    batches = make_batches(range(len(rows)), [len(r) for r in rows], 8)
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "tokens": tokens, "batches": len(batches),
           "cpus": os.cpu_count(), "host": host_speeds(), "sdpa": a.sdpa,
           "shapes": len({max(len(rows[i]) for i in b) for b in batches})}
    print("host", json.dumps(res["host"]), flush=True)
    if a.check:
        res["check_deferred"] = check_deferred(model, rows, batches, layer_ids)
        print("check_deferred", json.dumps(res["check_deferred"]), flush=True)
    for mode in a.modes.split(","):
        step, finish, cleanup, m = make_step(mode, model, rows, layer_ids, a.work, cfg["hidden_size"], len(layer_ids))
        r = {"experts": getattr(m.config, "_experts_implementation", None), "attn": m.config._attn_implementation}
        t0 = time.time()
        for b in batches:  # first pass (cold if this mode is the process's first): per-shape setup, pools filled
            step(b)
        finish()
        r["first_tok_s"] = round(tokens / (time.time() - t0), 1)
        t0 = time.time()
        for b in batches:
            step(b)
        finish()
        r["tok_s"] = round(tokens / (time.time() - t0), 1)
        mid = len(batches) // 2
        r["profile_10"] = profile(step, finish, batches[mid - 5: mid + 5], m)
        cleanup()
        del step, finish, m
        torch.cuda.empty_cache()
        res[mode] = r
        print(mode, json.dumps(r), flush=True)
    for mode in a.modes.split(","):
        if mode != "bare" and "bare" in res:
            res[mode]["ratio"] = round(res[mode]["tok_s"] / res["bare"]["tok_s"], 3)
    result(res)


if __name__ == "__main__":
    main()
