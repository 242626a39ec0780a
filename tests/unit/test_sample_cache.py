"""Stage 04 --online's data side, no model: the sample cache keeps to its budget, counts itself again after a kill
and regenerates a corrupt file; GPUs are split between the engine and training."""
import json
import os

import pytest



def _sample(folder, i, ids, n_states=4, hidden=8):
    import torch
    from eagle3pipe.formats.hidden_states import hs_path, save
    path = os.path.join(folder, f"gen-{i}.safetensors")
    save(path, {"hidden_states": torch.randn(len(ids), n_states, hidden).to(torch.bfloat16),
                "token_ids": torch.as_tensor(ids, dtype=torch.int64)})
    return path, hs_path


def test_cache_keeps_to_its_budget_recounts_and_regenerates_corrupt_files(tmp_path):
    from eagle3pipe.storage import outdir
    from eagle3pipe.train import sample_cache
    out = tmp_path / "out"
    outdir.claim("--output-dir", str(out), "train")
    cache, spool = out / "cache", out / "spool"
    outdir.make_dir(str(spool))
    sample_cache.prepare_cache(str(cache), 10_000)
    t = sample_cache.CacheTransfer(str(cache), 10_000, str(tmp_path / "skipped.jsonl"), 4, 4, 8, spool=str(spool))
    t.local = type("L", (), {})()
    ids = list(range(100))  # 100 tokens x 4 states x 8 x 2 bytes = 6.4 KB of states per file: one fits, two do not
    kept = []
    for i in range(3):
        path, hs_path = _sample(str(spool), i, ids)
        t.local.index = i
        t.delete(path)  # speculators' call once the sample is read: keep it if it fits, else remove it
        assert not os.path.exists(path)
        kept.append(os.path.exists(hs_path(str(cache), i)))
    assert kept == [True, False, False]
    used = int((cache / ".used").read_text())
    assert used == os.path.getsize(hs_path(str(cache), 0)) <= 10_000
    got = t.from_cache(0, ids)
    assert got["token_ids"].tolist() == ids and tuple(got["hidden_states"].shape) == (100, 4, 8)
    assert t.from_cache(0, ids[::-1]) is None and not os.path.exists(hs_path(str(cache), 0))  # wrong tokens: dropped
    assert int((cache / ".used").read_text()) == 0

    # a killed run's leftovers: files the count missed, a smaller budget next time; and a person's file of our name
    for i in (7, 8):
        path, _ = _sample(str(spool), i, ids)
        outdir.install(path, hs_path(str(cache), i))
    path, _ = _sample(str(tmp_path), 6, ids)
    os.replace(path, hs_path(str(cache), 6))
    files, used = sample_cache.prepare_cache(str(cache), 10_000)
    assert files == 1 and used <= 10_000
    assert sorted(n for n in os.listdir(cache) if n.startswith("hs_")) == ["hs_6.safetensors", "hs_7.safetensors"]
    st = os.stat(cache / "hs_7.safetensors")
    data = bytearray((cache / "hs_7.safetensors").read_bytes())
    data[-3] ^= 0x10
    (cache / "hs_7.safetensors").write_bytes(bytes(data))
    os.utime(cache / "hs_7.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))  # a flipped bit: same size and time
    assert t.from_cache(7, ids) is None and not (cache / "hs_7.safetensors").exists()  # CRC: generated again
    t.skipped(np_int(5), "non-finite")
    assert json.loads((tmp_path / "skipped.jsonl").read_text())["row"] == 5


def np_int(x):
    import numpy as np
    return np.int64(x)


def test_gpu_split_between_engine_and_training():
    from eagle3pipe.config.cli import UsageError
    from eagle3pipe.train.online_plan import split_gpus
    assert split_gpus(None, 0) == ([], [])
    assert split_gpus(None, 1) == ([0], [0])  # one GPU: shared
    assert split_gpus(None, 2) == ([0], [1])
    assert split_gpus(None, 8) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert split_gpus([0, 1, 2, 3, 4, 5, 6, 7], 8) == (list(range(8)), list(range(8)))  # all: training shares them
    with pytest.raises(UsageError, match="2 GPU"):
        split_gpus([2], 2)
