"""fp8 hidden states travel to the GPU as the bytes stored, and are dequantized there.

Converting fp8 to bf16 is the costliest step of a data-loader worker on a CPU (a table gather over every value: 150-240
ms of a 2,048-token sample at Kimi's width, against 30-60 ms to read and check it) and doubles the bytes every later
step moves: speculators' collate, the shared memory between worker and trainer, the pinned copy to the GPU. So stage
04, training on an fp8 folder:
- a worker hands on the stored bytes with each token's scale beside them (`pack`: uint8 [T, L+1, H+4], each layer row
  followed by the 4 bytes of its token's fp32 scale, so that speculators' dataset can split off the last layer and
  flatten the others as it does for bf16);
- speculators' collate copies those bytes into a uint8 batch (`ByteDataset`: the dataset's states dtype is uint8);
- the training process moves the batch to the GPU and dequantizes it there (`Unpack`), computing what speculators'
  FP8Transfer computes on the host, `q.to(dtype) * scale.to(dtype)`, bit for bit (tests/unit/test_fp8_transport.py;
  on an H200 against the CPU's table, every byte pattern: NaN payloads aside, and stage 02 writes no NaN code).

Shapes, with N the batch's packed token count (speculators' `total_seq_len`) and L the auxiliary layers:
    worker:      hidden_states [T, L+1, H] fp8 + scales [T, 1, 1] fp32  ->  uint8 [T, L+1, H+4]
    dataset:     hidden_states uint8 [T, L*(H+4)],  verifier_last_hidden_states uint8 [T, H+4]
    collate:     uint8 [1, N, L*(H+4)] and [1, N, H+4]; padding is zero bytes (scale 0.0, so values 0)
    trainer:     dtype [1, N, L*H] and [1, N, H], on the GPU
A batch whose every sample was unavailable is speculators' placeholder, already [1, N, L*H] of zeros: it stays zeros.
"""
import logging

from .hidden_states import fp8_to

log = logging.getLogger("eagle3")
SCALE_BYTES = 4  # a token's fp32 scale, after each of its layer rows


def pack(q, scale):
    """fp8 [T, L+1, H] and its per-token scales [T, 1, 1] fp32 -> uint8 [T, L+1, H+4] (one copy, no conversion)."""
    import torch
    t, n, h = q.shape
    out = torch.empty((t, n, h + SCALE_BYTES), dtype=torch.uint8)
    out[..., :h] = q.view(torch.uint8)
    out[..., h:] = scale.to(torch.float32).contiguous().view(torch.uint8).view(t, 1, SCALE_BYTES)
    return out


def unpack(packed, n_rows, hidden, dtype):
    """uint8 [..., n_rows*(hidden+4)] (pack's rows, split and collated by speculators) -> `dtype` [..., n_rows*hidden]
    on `packed`'s device. speculators' empty-batch placeholder ([..., n_rows*hidden], no scales) comes back as zeros."""
    import torch
    lead, width = packed.shape[:-1], packed.shape[-1]
    if width == n_rows * hidden:
        return torch.zeros(packed.shape, dtype=dtype, device=packed.device)
    if width != n_rows * (hidden + SCALE_BYTES) or packed.dtype != torch.uint8:
        raise ValueError(f"fp8 batch of {packed.dtype} width {width}: expected uint8 {n_rows} x ({hidden} + "
                         f"{SCALE_BYTES}) (a loader other than stage 04's?)")
    rows = packed.view(*lead, n_rows, hidden + SCALE_BYTES)
    q = rows[..., :hidden].view(torch.float8_e4m3fn)  # same item size: a view of the strided slice, no copy
    scale = rows[..., hidden:].contiguous().view(torch.float32)  # [..., n_rows, 1]
    # the GPU converts fp8 natively; a CPU gathers from the 256 possible values (hidden_states.fp8_to), same bits
    out = q.to(dtype).mul_(scale.to(dtype)) if packed.is_cuda else fp8_to(q, scale, dtype)  # one full-size tensor
    return out.reshape(*lead, n_rows * hidden)


class Unpack:
    """The training process's step between speculators' loader and its trainer: the batch's two state tensors moved
    to `device` (from pinned memory, without waiting) and dequantized there to `dtype` (a torch dtype name); the
    trainer's own `.to(device)` then finds them in place."""

    def __init__(self, device, n_aux, hidden, dtype):
        self.device, self.n_aux, self.hidden, self.dtype = device, n_aux, hidden, dtype

    def __call__(self, batch):
        import torch
        dtype = getattr(torch, self.dtype)
        for key, n in (("hidden_states", self.n_aux), ("verifier_last_hidden_states", 1)):
            batch[key] = unpack(batch[key].to(self.device, non_blocking=True), n, self.hidden, dtype)
        return batch


def dataset_class():
    """speculators' ArrowDataset with uint8 states: its collate then copies the workers' bytes as they are.
    Defined on first use (speculators imports torch), under a module-level name so that spawned workers find it."""
    global ByteDataset
    if "ByteDataset" in globals():
        return ByteDataset
    import torch
    from speculators.train.data import ArrowDataset

    class ByteDataset(ArrowDataset):
        def __init__(self, *args, **kwargs):
            kwargs["hidden_states_dtype"] = torch.uint8
            super().__init__(*args, **kwargs)

    ByteDataset.__module__ = __name__
    ByteDataset.__qualname__ = "ByteDataset"
    return ByteDataset


def __getattr__(name):  # a spawned worker unpickling the dataset looks the class up by name before anyone defined it
    if name == "ByteDataset":
        return dataset_class()
    raise AttributeError(name)
