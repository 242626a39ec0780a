"""fp8 states travel as bytes (fp8_transport.py): through speculators' own dataset and collate, a packed batch
dequantized where the trainer runs equals, bit for bit, the batch the workers used to dequantize themselves, in each
compute dtype, with samples of different lengths, a missing sample, padding and an all-empty batch; and it moves half
the bytes. (Stage 04 on an fp8 folder with a spawned data-loader worker: tests/slow/test_shards.py.)"""
import json

import datasets
import pytest
import torch
from speculators.train.data import ArrowDataset, CollateFn

from eagle3pipe.formats import fp8_transport
from eagle3pipe.formats import hidden_states as hs
from eagle3pipe.train.train_data import CheckedFiles

L, H, N = 3, 48, 160  # states per token (2 auxiliary + the last), hidden size, a batch's packed tokens
LENGTHS = (37, 0, 61, 50)  # row 1 has no file (stage 02 could not extract it): speculators skips it


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    rows = []
    for i, t in enumerate(LENGTHS):
        ids = torch.randint(0, 1000, (max(t, 1),))
        rows.append(ids.tolist())
        if t:
            x = torch.randn(t, L, H) * torch.tensor([1.0, 40.0, 900.0]).view(1, L, 1)
            q, scale = hs.quantize_fp8(x)
            hs.save(hs.hs_path(d, i), {"hidden_states": q, hs.SCALES: scale, "token_ids": ids})
    ds = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows],
                                     "seq_len": [len(r) for r in rows]})
    ds.set_format(type="torch")
    ds.save_to_disk(str(d / "table"))
    return d


def batch(folder, dataset_class, packed, dtype, indices):
    """One batch as speculators' loader makes it: the dataset's items, then its collate."""
    transfer = CheckedFiles(str(folder), L, H, str(folder / "skipped.jsonl"), rows=len(LENGTHS), dtype=dtype,
                            failed={1}, packed=packed)
    ds = dataset_class(max_len=N, datapath=str(folder / "table"), transfer=transfer, on_missing="skip",
                       hidden_states_dtype=getattr(torch, dtype))
    collate = CollateFn(N, H, num_target_layers=L - 1, dtype=ds.hidden_states_dtype)
    return collate([ds[i] for i in indices])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("indices", [[0, 1, 2], [2, 3, 0], [1]])  # padded; truncated at N; every sample missing
def test_bytes_dequantized_by_the_trainer_equal_the_workers_conversion(folder, dtype, indices):
    before = batch(folder, ArrowDataset, False, dtype, indices)
    packed = batch(folder, fp8_transport.dataset_class(), True, dtype, indices)
    if indices != [1]:  # bytes: one per value and four per token and state, against bf16's two per value
        assert packed["hidden_states"].dtype == torch.uint8
        assert packed["hidden_states"].nbytes < 0.55 * before["hidden_states"].to(torch.bfloat16).nbytes
    after = fp8_transport.Unpack("cpu", L - 1, H, dtype)(packed)
    assert set(after) == set(before)
    for key, want in before.items():
        got = after[key]
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key  # bit for bit
        else:
            assert got == want, key
    if indices == [1]:
        assert not after["hidden_states"].any() and (after["document_ids"] == -1).all()


def test_a_batch_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="expected uint8 2 x"):
        fp8_transport.unpack(torch.zeros(1, 4, 2 * H + 3, dtype=torch.uint8), 2, H, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        fp8_transport.unpack(torch.zeros(1, 4, 2 * (H + 4), dtype=torch.bfloat16), 2, H, torch.bfloat16)



def test_a_bf16_file_in_an_fp8_folder_is_skipped_by_name(folder, tmp_path):
    """Batches of an fp8 folder are collated as bytes: a file of another dtype there (not stage 02's) is a bad
    sample, named in logs/skipped.jsonl, not a crashed worker or a batch silently zeroed."""
    import shutil
    for name in ("hs_0.safetensors", "hs_2.safetensors"):
        shutil.copy(folder / name, tmp_path / name)
    x = torch.randn(LENGTHS[0], L, H).to(torch.bfloat16)
    ids = hs.load_sample(hs.hs_path(folder, 0), L, H)[1]["token_ids"]
    hs.save(hs.hs_path(tmp_path, 0), {"hidden_states": x, "token_ids": ids})
    t = CheckedFiles(str(tmp_path), L, H, str(tmp_path / "skipped.jsonl"), rows=200, packed=True)
    assert t.get_cached(0) is None and t.get_cached(2)["hidden_states"].dtype == torch.uint8
    assert "bfloat16 states in an fp8 folder" in (tmp_path / "skipped.jsonl").read_text()


def test_a_file_holding_another_row_is_skipped_by_name(folder, tmp_path):
    """A valid file copied or renamed over another row's (same format, another sample's tokens) is a bad sample named
    in logs/skipped.jsonl, not a batch that comes out empty with nothing recorded."""
    import array
    import shutil
    from eagle3pipe.train.train_data import ids_digest
    ids = [hs.load_sample(hs.hs_path(folder, i), L, H)[1]["token_ids"].tolist() for i in (0, 2)]
    shutil.copy(folder / "hs_0.safetensors", tmp_path / "hs_0.safetensors")
    shutil.copy(folder / "hs_0.safetensors", tmp_path / "hs_2.safetensors")  # row 0's states under row 2's name
    digests = array.array("q", [ids_digest(ids[0]), 0, ids_digest(ids[1])])
    t = CheckedFiles(str(tmp_path), L, H, str(tmp_path / "skipped.jsonl"), rows=200, packed=True, digests=digests)
    assert t.get_cached(0) is not None and t.get_cached(2) is None
    line = json.loads((tmp_path / "skipped.jsonl").read_text())
    assert line["row"] == 2 and "token_ids are not this row's" in line["reason"]


def test_scales_past_the_largest_stage_02_wrote_are_a_bad_sample(folder, tmp_path):
    """A file whose scales reach past what stage 02 wrote (its manifest's fp8_scale_max, the largest over the scale_max
    each file records) holds states the verifier never computed: scales of 1e30 with a checksum that fits are still
    skipped by name; so is a scale below the clamp stage 02 quantizes with."""
    from eagle3pipe.extract.extract_output import largest_scale
    for i in (0, 2, 3):
        t = hs.load_sample(hs.hs_path(folder, i), L, H)[1]
        hs.save(hs.hs_path(tmp_path, i), t, **hs.scale_note(t))
    bound = largest_scale(str(tmp_path), [0, 2, 3])
    assert bound == max(float(hs.load_sample(hs.hs_path(folder, i), L, H)[1][hs.SCALES].max()) for i in (0, 2, 3))
    for i, factor in ((0, 1e30 / bound), (2, 1e-20)):
        t = dict(hs.load_sample(hs.hs_path(folder, i), L, H)[1])
        t[hs.SCALES] = t[hs.SCALES] * factor
        hs.save(hs.hs_path(tmp_path, i), t)  # a valid file: its checksum fits its data
    t = CheckedFiles(str(tmp_path), L, H, str(tmp_path / "skipped.jsonl"), rows=200, packed=True, scale_max=bound)
    assert t.get_cached(0) is None and t.get_cached(2) is None and t.get_cached(3) is not None
    reasons = [json.loads(line)["reason"] for line in (tmp_path / "skipped.jsonl").read_text().splitlines()]
    assert reasons[0].startswith("fp8 scales up to 1e+30, above the largest stage 02 wrote") \
        and "below the 1e-12 stage 02 clamps them at" in reasons[1], reasons
    assert largest_scale(str(tmp_path), [0, 2, 3]) is None  # files that record none: no bound, not a wrong one
