"""Benchmark: one step of torch's Muon optimizer (speculators' default) on SmolLM2 draft-shaped matrices, with its
Newton-Schulz iterations in bf16 (torch's hard-coded choice) and in float32 (what stage 04 uses when it computes in
float32: eagle3pipe/adapters.py muon_in_float32), in one process.

    python -m bench.bench_muon_cpu                 # this CPU's kernels
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python -m bench.bench_muon_cpu

Prints one RESULT line (JSON): seconds per optimizer step for each, and their ratio.
"""

from bench.common import result
import time


# the draft's 2-D matrices for SmolLM2 (hidden 576, 9/3 heads, MLP 1536, draft vocab 8192): lm_head, fc, q/k/v/o,
# gate/up/down
SHAPES = [(8192, 576), (576, 1728), (576, 1152), (192, 1152), (192, 1152), (576, 576), (1536, 576), (1536, 576),
          (576, 1536)]


def step_seconds(repeats=2):
    import torch
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s) * 0.02) for s in SHAPES]
    opt = torch.optim.Muon(params, lr=0.02)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # warm-up (momentum buffers)
    t = time.time()
    for _ in range(repeats):
        opt.step()
    return (time.time() - t) / repeats


def main():
    import torch
    from eagle3pipe.adapters import muon_in_float32
    res = {"torch_capability": torch.backends.cpu.get_cpu_capability(), "bf16_s": round(step_seconds(), 3)}
    with muon_in_float32("float32"):
        res["float32_s"] = round(step_seconds(), 3)
    res["bf16_over_float32"] = round(res["bf16_s"] / res["float32_s"], 2)
    result(res)


if __name__ == "__main__":
    main()
