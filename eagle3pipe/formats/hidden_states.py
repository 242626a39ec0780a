"""Hidden-state files: `hs_{i}.safetensors` per row i of tokenized_data.jsonl.

    hidden_states         [T, L+1, H] bf16   the auxiliary layer ids in order, then id n (last layer, pre-norm)
                          (or float8_e4m3fn with --storage-dtype fp8, see below)
    hidden_states_scales  [T, 1, 1] fp32     fp8 only: per-token scale, value = fp8 * scale
    token_ids             [T] int64          equal to the row's input_ids
    __metadata__          {"crc32": ...}     CRC-32 of the data section (everything after the header)

bf16 files are what vLLM's ExampleHiddenStatesConnector writes and what speculators' trainer reads; fp8 files are
what speculators' `fp8` hidden-states backend (hs_connectors.FP8Transfer) dequantizes. The CRC lets a resume or a
training run tell a bit-flipped file from a good one; readers that do not know it ignore it.

Position t holds the states computed *at* token t (the verifier has seen tokens 0..t); the trainer does the shift
that pairs them with token t+1.
"""
import json
import math
import os
import struct
import zlib

from ..adapters import interrupted
from ..base import faults
from ..storage.files import atomic_path, open_input

HS_NAME = "hs_{}.safetensors"
SCALES = "hidden_states_scales"
STORAGE_DTYPES = ("bf16", "fp8")
BYTES_PER_VALUE = {"bf16": 2, "fp8": 1}
_ST_DTYPES = {"torch.bfloat16": "BF16", "torch.float8_e4m3fn": "F8_E4M3", "torch.float32": "F32",
              "torch.int64": "I64", "torch.float16": "F16"}
_TORCH_DTYPES = {st: name.split(".")[1] for name, st in _ST_DTYPES.items()}  # "BF16" -> "bfloat16"


SCALE_MIN = 1e-12  # quantize_fp8's least scale (a token of zeros)


class Pending:
    """One sample's host tensors ({"hidden_states": [T, L+1, H], maybe "hidden_states_scales": [T, 1, 1]}) and
    `bad` (a 0-d bool tensor: non-finite values), valid once `event` (a CUDA event; None on CPU) has completed:
    the device-to-host copy runs behind the next batch's compute."""
    __slots__ = ("tensors", "event", "bad")

    def __init__(self, tensors, event=None, bad=False):
        self.tensors, self.event, self.bad = tensors, event, bad


def hs_path(folder, i):
    return os.path.join(folder, HS_NAME.format(i))


def bytes_per_token(n_states, hidden, storage="bf16"):
    return n_states * hidden * BYTES_PER_VALUE[storage] + 8 + (4 if storage == "fp8" else 0)


def quantize_fp8(states):
    """[T, L+1, H] float -> (fp8 [T, L+1, H], scale [T, 1, 1] fp32): one scale per token over all its layers,
    amax mapped to e4m3's largest value (448). Runs wherever `states` lives (on the GPU before the host copy)."""
    import torch
    x = states.float()
    scale = (x.abs().amax(dim=(1, 2), keepdim=True) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=SCALE_MIN)
    return (x / scale).to(torch.float8_e4m3fn), scale


def dequantize(tensors):
    """{hidden_states, [hidden_states_scales]} -> bf16 hidden_states [T, L+1, H], computed as speculators' FP8Transfer
    does (in bf16), so that what our tools see is what the trainer sees."""
    import torch
    hs = tensors["hidden_states"]
    if SCALES in tensors:
        return hs.to(torch.bfloat16) * tensors[SCALES].to(torch.bfloat16)
    return hs


def save(path, tensors, **metadata):
    """Write {name: contiguous CPU tensor} as safetensors with a CRC-32 of the data (and any `metadata` strings)
    in the header, atomically (a temporary name in the same folder, renamed when complete). The tensors' memory is
    written as is, no intermediate copy. The CRC is computed chunk by chunk just before each chunk is written, while
    it is still in the CPU's cache (one pass over the data instead of two), and the header is written last in place
    of a placeholder of the same length. zlib and the writes release the GIL, so several writer threads overlap."""
    import torch
    header, views, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        mv = memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        header[name] = {"dtype": _ST_DTYPES[str(t.dtype)], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(mv)]}
        offset += len(mv)
        views.append(mv)

    def encode(crc):
        header["__metadata__"] = {"format": "pt", "crc32": f"{crc:08x}", **{k: str(v) for k, v in metadata.items()}}
        raw = json.dumps(header, separators=(",", ":")).encode()
        return struct.pack("<Q", len(raw) + (-len(raw) % 8)) + raw + b" " * (-len(raw) % 8)  # data 8-byte aligned

    head, crc = encode(0), 0  # the placeholder: "00000000", as long as any CRC's hex
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(head)
            for k, mv in enumerate(views):
                for at in range(0, len(mv), _CHUNK):
                    crc = zlib.crc32(mv[at: at + _CHUNK], crc)
                    f.write(mv[at: at + _CHUNK])
                if k == 0:
                    faults.kill_point("write")  # a reliability test: die with the file half written
            final = encode(crc)
            assert len(final) == len(head)  # fixed-width hex: the data section does not move
            f.seek(0)
            f.write(final)


_CHUNK = 1 << 20  # fits in a core's L2 cache


def read_header(path):
    """-> (header dict, data offset, file size); raises ValueError/OSError on a truncated or foreign file."""
    size = os.path.getsize(path)
    with open_input(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, 100_000_000):
            raise ValueError("truncated or not safetensors (header length beyond the file)")
        header = json.loads(f.read(n))
    return header, 8 + n, size


def check_header(path, n_tokens, n_states, hidden):
    """Cheap check (no data read): header parses, shapes match the row, the size adds up. None or the reason."""
    try:
        header, start, size = read_header(path)
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"unreadable ({type(e).__name__}: {str(e)[:80]})"
    hs, tid = header.get("hidden_states"), header.get("token_ids")
    if not isinstance(hs, dict) or not isinstance(tid, dict):
        return f"missing tensors (has {sorted(k for k in header if k != '__metadata__')})"
    if hs.get("shape") != [n_tokens, n_states, hidden] or tid.get("shape") != [n_tokens]:
        return f"hidden_states shape {hs.get('shape')}, expected {[n_tokens, n_states, hidden]}"
    if hs.get("dtype") not in ("BF16", "F8_E4M3") or tid.get("dtype") != "I64":
        # the format whatever the compute dtype: a float32 engine's states are rounded to bf16 before they are written
        return f"hidden_states stored as {hs.get('dtype')} / token_ids as {tid.get('dtype')}, expected BF16 (or " \
               f"F8_E4M3) / I64"
    if hs.get("dtype") == "F8_E4M3" and not isinstance(header.get(SCALES), dict):
        return f"fp8 hidden_states without {SCALES}"
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    if start + end != size:
        return f"size {size} B, header says {start + end} B (truncated or padded)"
    return None


def load_sample(path, n_states, hidden, scale_max=None):
    """A training sample read once and checked where it is read: header (shapes, dtypes, size), CRC-32 over the data
    as read, finite values, fp8 scales within (0, scale_max] (stage 02's record of the largest it wrote: amax/448 of
    the verifier's own states; a file whose scales reach past it holds states stage 02 never computed). -> (None,
    {name: tensor}) or (the reason, None). The file is read whole into one buffer
    and the tensors are views of it (no second copy); the finite check is a min/max pass (NaN and +-inf reach one of
    them), 40x cheaper on a CPU than an elementwise isfinite over bf16 (bench/profile_loader.py)."""
    try:
        faults.signal_point("read")  # a reliability test: a stop signal that lands during the read
        header, start, size = read_header(path)
        n_tokens = (header.get("token_ids") or {}).get("shape", [None])[0]
        reason = check_header(path, n_tokens, n_states, hidden)
        if reason:
            return reason, None
        import numpy as np
        buf = np.empty(size, dtype=np.uint8)  # not zero-filled first, as a bytearray would be
        with open_input(path, "rb") as f:
            got = f.readinto(buf)
        if got != size:
            return f"size changed while read ({got} of {size} B)", None
        want = (header.get("__metadata__") or {}).get("crc32")
        if want is not None and f"{zlib.crc32(memoryview(buf)[start:]):08x}" != want:
            return "checksum mismatch: corrupt data", None
        tensors = _views(buf, start, header)
    except Exception as e:  # noqa: BLE001 - any way a file is unreadable makes the sample unavailable, named
        if interrupted(e):  # a stop signal that landed during the read: the run's, not the file's
            raise
        return f"unreadable ({type(e).__name__}: {str(e)[:80]})", None
    if not finite(tensors[SCALES] if SCALES in tensors else tensors["hidden_states"]):
        return "non-finite values", None
    if SCALES in tensors and tensors[SCALES].numel():
        reason = scales_outside(tensors[SCALES], scale_max)
        if reason:
            return reason, None
    return None, tensors


def scales_outside(scales, scale_max):
    """Why fp8 `scales` are not stage 02's, or None: quantize_fp8 clamps each at SCALE_MIN and above; stage 02's
    manifest records the largest it wrote (fp8_scale_max; None: a folder from before it was recorded)."""
    import torch
    lo, hi = (float(v) for v in torch.aminmax(scales.float()))
    if lo < SCALE_MIN:
        return f"fp8 scales down to {lo:.3g}, below the {SCALE_MIN:g} stage 02 clamps them at"
    if scale_max is not None and hi > scale_max * (1 + 1e-6):
        return f"fp8 scales up to {hi:.3g}, above the largest stage 02 wrote ({scale_max:.3g}, its manifest's fp8_scale_max)"
    return None


def scale_note(tensors):
    """The header metadata that records an fp8 file's largest scale ({} for bf16): stage 02's manifest takes the
    largest over its files (fp8_scale_max), the bound stage 04 holds every file to."""
    return {"scale_max": repr(float(tensors[SCALES].max()))} if SCALES in tensors and tensors[SCALES].numel() else {}


def _views(buf, start, header):
    """{name: tensor} viewing `buf` (a writable buffer: a whole safetensors file from byte 0; data from `start`). Raises ValueError where
    a tensor's offsets disagree with its dtype and shape or leave the data, KeyError on a dtype not ours."""
    import torch
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = getattr(torch, _TORCH_DTYPES[meta["dtype"]]), [int(n) for n in meta["shape"]]
        a, b = (int(x) for x in meta["data_offsets"])
        n = math.prod(shape)
        if not 0 <= a <= b <= len(buf) - start or b - a != n * dtype.itemsize:
            raise ValueError(f"{name}: data offsets {a}-{b} disagree with {meta['dtype']} {shape}")
        out[name] = torch.frombuffer(buf, dtype=dtype, count=n, offset=start + a).view(shape) if n else \
            torch.empty(shape, dtype=dtype)
    return out


def finite(t):
    """True when every value of `t` is finite: NaN propagates to torch.aminmax's min and max, +inf reaches the max
    and -inf the min, so one reduction answers (an elementwise isfinite writes a mask as large as `t`)."""
    import torch
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) and torch.isfinite(hi))


def fp8_to(q, scale, dtype):
    """fp8 states [T, L+1, H] with per-token scales [T, 1, 1] -> `dtype`, bit for bit what speculators' FP8Transfer
    computes (`q.to(dtype) * scale.to(dtype)`), 3x faster on a CPU: the 256 possible fp8 values converted once into
    a table and gathered by numpy instead of converted one by one, then scaled in place."""
    import numpy as np
    import torch
    ints = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[dtype.itemsize]
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(dtype).view(getattr(torch, ints.__name__))
    out = np.take(table.numpy(), q.contiguous().view(torch.uint8).numpy())
    return torch.from_numpy(out).view(dtype).mul_(scale.to(dtype))


def verify_crc(path):
    """None when the data section matches the header's CRC-32 (or the file carries none), else the reason."""
    header, start, _ = read_header(path)
    want = (header.get("__metadata__") or {}).get("crc32")
    if want is None:
        return None
    crc = 0
    with open_input(path, "rb") as f:
        f.seek(start)
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return None if f"{crc:08x}" == want else f"checksum mismatch (crc32 {crc:08x}, header says {want}): corrupt data"


def read_token_ids(path):
    """The file's token_ids [T] as a list, read from the header's offsets (no torch)."""
    import numpy as np
    header, start, _ = read_header(path)
    tid = header["token_ids"]
    a, b = tid["data_offsets"]
    with open_input(path, "rb") as f:
        f.seek(start + a)
        return np.frombuffer(f.read(b - a), dtype="<i8").tolist()


def check_file(path, token_ids, n_states, hidden):
    """Full check: header, checksum, token ids, finite values. None when the file is right for this row."""
    return load_checked(path, token_ids, n_states, hidden)[0]


def load_checked(path, token_ids, n_states, hidden):
    """-> (None, {name: tensor}) when the file is right for this row, else (the reason, None)."""
    reason = check_header(path, len(token_ids), n_states, hidden)
    if reason:
        return reason, None
    import torch
    from safetensors import safe_open
    try:
        reason = verify_crc(path)
        if reason:
            return reason, None
        with safe_open(path, "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # corrupt in a way the header check missed
        if interrupted(e):
            raise
        return f"unreadable ({type(e).__name__}: {str(e)[:80]})", None
    if not torch.equal(tensors["token_ids"].to(torch.int64), torch.as_tensor(token_ids, dtype=torch.int64)):
        return "token_ids differ from the prepared row", None
    # fp8 states are finite iff their per-token scales are (amax propagates NaN and inf)
    if not finite(tensors[SCALES] if SCALES in tensors else tensors["hidden_states"]):
        return "non-finite values", None
    return None, tensors
