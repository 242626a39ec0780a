"""The hidden-state file format: our writer's files read back through safetensors and through speculators' own
loaders (bf16 FileTransfer, fp8 FP8Transfer), the CRC catches a flipped bit, the header check catches truncation,
and fp8's per-token scaling keeps the error within e4m3's precision."""
import os

import pytest
import torch
from hs_connectors.transfer import FileTransfer, FP8Transfer
from pathlib import Path
from safetensors.torch import load_file

from eagle3pipe.formats import hidden_states as hs


T, L, H = 37, 4, 64


def states():
    torch.manual_seed(0)
    x = torch.randn(T, L, H) * torch.tensor([1.0, 30.0, 300.0, 3000.0]).view(1, L, 1)  # layers of different scale
    x[0] *= 50  # an outlier token (the first token's "massive activations")
    return x.to(torch.bfloat16)


def write(folder, i, storage):
    x, ids = states(), torch.arange(T)
    tensors = {"hidden_states": x, "token_ids": ids}
    if storage == "fp8":
        tensors["hidden_states"], tensors[hs.SCALES] = hs.quantize_fp8(x)
    hs.save(hs.hs_path(folder, i), tensors)
    return x, ids.tolist()


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_roundtrip_through_speculators_loaders(tmp_path, storage):
    x, ids = write(tmp_path, 0, storage)
    assert hs.check_file(hs.hs_path(tmp_path, 0), ids, L, H) is None
    size = os.path.getsize(hs.hs_path(tmp_path, 0))
    header, start, _ = hs.read_header(hs.hs_path(tmp_path, 0))
    assert size - start == T * hs.bytes_per_token(L, H, storage)  # the preflight's disk estimate is exact
    loaded = (FP8Transfer if storage == "fp8" else FileTransfer)(Path(tmp_path)).get_cached(0)
    assert loaded["token_ids"].tolist() == ids
    assert loaded["hidden_states"].dtype == torch.bfloat16 and loaded["hidden_states"].shape == (T, L, H)
    if storage == "bf16":
        assert torch.equal(loaded["hidden_states"], x)
    else:  # e4m3 has 3 mantissa bits: <= 1/16 relative error per value, about 2-3 % RMS over a layer
        err = (loaded["hidden_states"].float() - x.float()).norm(dim=(0, 2)) / x.float().norm(dim=(0, 2))
        assert (err < 0.05).all(), err
        assert torch.equal(loaded["hidden_states"], hs.dequantize(load_file(hs.hs_path(tmp_path, 0))))


def test_bit_flip_and_truncation_are_named(tmp_path):
    _, ids = write(tmp_path, 0, "bf16")
    path = hs.hs_path(tmp_path, 0)
    data = bytearray(open(path, "rb").read())
    data[-100] ^= 0x04  # one bit in the data section: still a valid safetensors file of the right size
    open(path, "wb").write(bytes(data))
    assert load_file(path)["hidden_states"].shape == (T, L, H)  # safetensors alone cannot tell
    assert "checksum mismatch" in hs.check_file(path, ids, L, H)
    open(path, "wb").write(bytes(data[: len(data) // 2]))
    assert "truncated" in hs.check_header(path, T, L, H)
    assert "truncated" in hs.check_file(path, ids, L, H)
    open(path, "wb").write(b"\x00" * 5)
    assert "unreadable" in hs.check_file(path, ids, L, H)
    assert hs.check_file(hs.hs_path(tmp_path, 9), ids, L, H) == "missing"


def test_wrong_row_or_shape_is_named(tmp_path):
    _, ids = write(tmp_path, 0, "fp8")
    path = hs.hs_path(tmp_path, 0)
    assert "token_ids differ" in hs.check_file(path, ids[::-1], L, H)
    assert "shape" in hs.check_file(path, ids, L + 1, H)


def test_non_finite_values_are_refused(tmp_path):
    x, ids = states(), torch.arange(T)
    x[3, 1, 5] = float("inf")
    hs.save(hs.hs_path(tmp_path, 0), {"hidden_states": x, "token_ids": ids})
    assert hs.check_file(hs.hs_path(tmp_path, 0), ids.tolist(), L, H) == "non-finite values"
    q, scale = hs.quantize_fp8(x)  # amax propagates the inf into that token's scale
    assert not torch.isfinite(scale[3]).all() and torch.isfinite(scale[:3]).all()


def test_checksum_over_several_chunks(tmp_path):
    """A sample larger than the writer's CRC chunk (the CRC is computed chunk by chunk beside the writes, and the
    header written last): the header's CRC is zlib's over the whole data section, every tensor reads back intact,
    and a flipped bit past the first chunk is caught."""
    import zlib
    torch.manual_seed(1)
    n = 3 * hs._CHUNK // (L * H * 2) + 5  # tokens: a bit over three chunks of bf16 states
    x, ids = torch.randn(n, L, H).to(torch.bfloat16), torch.arange(n)
    path = hs.hs_path(tmp_path, 0)
    hs.save(path, {"hidden_states": x, "token_ids": ids}, note="kept")
    header, start, _ = hs.read_header(path)
    data = open(path, "rb").read()
    assert header["__metadata__"] == {"format": "pt", "crc32": f"{zlib.crc32(data[start:]):08x}", "note": "kept"}
    loaded = load_file(path)
    assert torch.equal(loaded["hidden_states"], x) and torch.equal(loaded["token_ids"], ids)
    assert hs.check_file(path, ids.tolist(), L, H) is None
    flipped = bytearray(data)
    flipped[start + 2 * hs._CHUNK + 7] ^= 0x01
    open(path, "wb").write(bytes(flipped))
    assert "checksum mismatch" in hs.check_file(path, ids.tolist(), L, H)


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_the_loader_reads_what_speculators_reads_bit_for_bit(tmp_path, storage):
    """The training loader's fast path (one read, views, a min/max finite check, fp8 through a table) gives the
    tensors speculators' own loaders give, bit for bit, in every compute dtype."""
    from eagle3pipe.train.train_data import CheckedFiles
    write(tmp_path, 0, storage)
    ref = (FP8Transfer if storage == "fp8" else FileTransfer)(Path(tmp_path)).get_cached(0)
    reason, t = hs.load_sample(hs.hs_path(tmp_path, 0), L, H)
    assert reason is None and set(t) == set(load_file(hs.hs_path(tmp_path, 0)))
    for dtype in ("bfloat16", "float32"):
        got = CheckedFiles(str(tmp_path), L, H, str(tmp_path / "skipped.jsonl"), rows=1, dtype=dtype).get_cached(0)
        assert got["token_ids"].tolist() == ref["token_ids"].tolist()
        if storage == "bf16" or dtype == "bfloat16":  # bf16 files as stored; fp8 as FP8Transfer gives them
            want = ref["hidden_states"]
        else:
            from hs_connectors.fp8_utils import dequantize_fp8_tensor
            want = dequantize_fp8_tensor(t["hidden_states"], t[hs.SCALES], dtype=torch.float32)
        assert got["hidden_states"].dtype == want.dtype and torch.equal(got["hidden_states"], want)


def test_fp8_table_equals_torch_s_conversion_for_every_byte():
    """All 256 fp8 bit patterns (NaN included) times scales: the table's result equals speculators' FP8Transfer
    arithmetic (`q.to(dtype) * scale.to(dtype)`) bit for bit."""
    from hs_connectors.fp8_utils import dequantize_fp8_tensor
    q = torch.arange(256, dtype=torch.uint8).repeat(3, 2, 1).view(torch.float8_e4m3fn)  # [3, 2, 256]
    scale = torch.tensor([0.5, 3.0, 1e-3]).view(3, 1, 1)
    for dtype, ints in ((torch.bfloat16, torch.int16), (torch.float16, torch.int16), (torch.float32, torch.int32)):
        assert torch.equal(hs.fp8_to(q, scale, dtype).view(ints), dequantize_fp8_tensor(q, scale, dtype).view(ints))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_value_anywhere_is_found(bad):
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(7, 3, 5).to(dtype)
        assert hs.finite(x)
        x[4, 2, 1] = bad
        assert not hs.finite(x)
    assert hs.finite(torch.empty(0, 4)) and hs.finite(torch.arange(5))


def test_a_header_whose_offsets_lie_is_unreadable_not_a_crash(tmp_path):
    """Offsets that disagree with a tensor's dtype and shape (same file size, valid CRC) are named, not viewed."""
    import json
    import struct
    import zlib
    write(tmp_path, 0, "bf16")
    path = hs.hs_path(tmp_path, 0)
    header, start, _ = hs.read_header(path)
    data = open(path, "rb").read()[start:]
    header["token_ids"]["data_offsets"][0] += 8  # one token id short, the file's size unchanged
    header["__metadata__"]["crc32"] = f"{zlib.crc32(data):08x}"
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    open(path, "wb").write(struct.pack("<Q", len(raw)) + raw + data)
    reason, t = hs.load_sample(path, L, H)
    assert t is None and reason.startswith("unreadable (ValueError: token_ids: data offsets"), reason
