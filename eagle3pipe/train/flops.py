"""The arithmetic of training throughput: a device's dense peak, the model FLOPs a trained token costs in an EAGLE-3
draft, Muon's work a step; MFU is their ratio (train_log.py prints it). No torch import: parameters come as (name,
shape, trainable)."""
from ..adapters import MUON_ADAMW_NAMES

# dense bf16 matmul peak per device, FLOP/s (the vendors' figures without sparsity): what MFU is a fraction of
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12, "B300": 2250e12,
             "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12, "A10": 125e12, "L4": 121e12}


def peak_flops(device_name, dtype):
    """The device's dense peak for `dtype`, or None where unknown (a CPU, float32, a GPU not in PEAK_BF16)."""
    if dtype not in ("bfloat16", "float16") or not device_name:
        return None
    words = device_name.upper().replace("-", " ").split()
    hits = [k for k in PEAK_BF16 if any(w.startswith(k) for w in words)]  # the longest: A100 before A10
    return PEAK_BF16[max(hits, key=len)] if hits else None


def draft_flops_per_token(named_params, ttt_steps):
    """Model FLOPs a trained token costs in an EAGLE-3 draft step, from its parameters' names and shapes
    (`named_params`: (name, shape, trainable)). A matrix costs 2 FLOP a weight forward, 2 more for the gradient of
    its input and 2 for its own when trained: the FC runs once (its input needs no gradient), the decoder layers and
    the draft head once per TTT step (speculators 0.9 freezes the head, but the gradient passes through it), the
    verifier's head forward only, once (the targets). The embedding is a lookup. Attention's scores, which grow with
    the sequence, are left out, as MFU figures usually leave them."""
    once = per_step = 0
    for name, shape, trainable in named_params:
        if len(shape) != 2 or "embed_tokens" in name:
            continue
        n = shape[0] * shape[1]
        if "verifier" in name:
            once += 2 * n
        elif name.startswith("fc.") or ".fc." in name:
            once += (6 if trainable else 2) * n
        else:
            per_step += (6 if trainable else 4) * n
    return once + ttt_steps * per_step


def muon_flops_per_step(named_params, ns_steps=5):
    """FLOPs of one optimizer step's Newton-Schulz iterations under Muon (`named_params`: (name, shape, trainable)).
    Muon orthogonalizes each trainable matrix with both sides over 1, embeddings and heads aside (speculators'
    split). For a matrix with sides m <= n, an iteration multiplies X by its transpose (2 m^2 n), squares the m x m
    Gram matrix (2 m^3) and multiplies the result by X again (2 m^2 n). Paid once a step, whatever the step's
    tokens: a wide draft (7168: about 107 TFLOP a step) pays as much for it as for its model FLOPs at 8k tokens."""
    total = 0
    for name, shape, trainable in named_params:
        if not trainable or len(shape) != 2 or min(shape) <= 1 or any(h in name for h in MUON_ADAMW_NAMES):
            continue
        m, n = sorted(shape)
        total += ns_steps * (4 * m * m * n + 2 * m ** 3)
    return total
