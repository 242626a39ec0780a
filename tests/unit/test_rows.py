"""Stage 01's rows as stages 02 and 04 hold them (eagle3pipe/storage/rows.py): one int32 array of ids, one uint8 array of
masks, offsets; read and checked line by line, the same rows, digest and Arrow table as the plain lists they replace."""
import hashlib
import json

import numpy as np
import pytest

from eagle3pipe.base.errors import UsageError
from eagle3pipe.storage.rows import Rows, read_rows, same_ids

ROWS = [([1, 2, 3], [0, 1, 1]), ([49151, 0], [1, 0]), ([7], [1]), ([5, 6, 7, 8, 9], [0, 0, 1, 1, 1])]


def write(folder, rows, extra=None):
    lines = [json.dumps({"input_ids": ids, "loss_mask": mask, **(extra or {})}) + "\n" for ids, mask in rows]
    (folder / "tokenized_data.jsonl").write_text("".join(lines))
    return "".join(lines).encode()


def as_lists(rows):
    return [(ids.tolist(), None if mask is None else mask.tolist()) for ids, mask in rows]


def test_rows_read_back_as_written_with_stage01s_digest(tmp_path):
    data = write(tmp_path, ROWS, {"id": "x"})
    rows = read_rows(str(tmp_path), len(ROWS), vocab_size=49152, longest=5)
    assert as_lists(rows) == ROWS
    assert rows.ids.dtype == np.int32 and rows.masks.dtype == np.uint8 and rows.offsets.dtype == np.int64
    assert rows.digest == hashlib.sha256(data).hexdigest()[:16]  # the content_id stage 04 checks stage 01's against
    assert rows.tokens == 11 and rows.lengths().tolist() == [3, 2, 1, 5]
    assert [ids.tolist() for ids in rows.token_ids()] == [ids for ids, _ in ROWS]
    no_masks = read_rows(str(tmp_path), len(ROWS), masks=False)
    assert no_masks.masks is None and as_lists(no_masks) == [(ids, None) for ids, _ in ROWS]
    assert no_masks.digest == rows.digest


def test_from_lists_equals_the_reader_and_slices_read_as_a_lists_do():
    rows = Rows.from_lists(ROWS)
    assert as_lists(rows) == ROWS and len(rows) == 4
    for s in (slice(None, 2), slice(2, None), slice(-3, -1), slice(3, 1), slice(0, 100)):
        assert as_lists(rows[s]) == ROWS[s], s
        assert rows[s].tokens == sum(len(ids) for ids, _ in ROWS[s])
    assert as_lists(rows[1:][1:]) == ROWS[2:]  # a slice of a slice keeps its parent's offsets
    assert rows[-1][0].tolist() == ROWS[-1][0]
    for bad in (4, -5):
        with pytest.raises(IndexError):
            rows[bad]
    with pytest.raises(ValueError, match="no step"):
        rows[::2]
    assert len(Rows.from_lists([])) == 0 and Rows.from_lists([]).tokens == 0


@pytest.mark.parametrize("row", [
    {"input_ids": [[1, 2]], "loss_mask": [1]},  # nested
    {"input_ids": [1, True], "loss_mask": [1, 1]},  # JSON true among ids: numpy would read it as 1
    {"input_ids": [1, 2.0], "loss_mask": [1, 1]},
    {"input_ids": [1, "2"], "loss_mask": [1, 1]},
    {"input_ids": [1, 2 ** 40], "loss_mask": [1, 1]},  # past int32 with no vocabulary given
    {"input_ids": [1, -1], "loss_mask": [1, 1]},
    {"input_ids": [1, 2], "loss_mask": [1, 2]},
    {"input_ids": [1, 2], "loss_mask": [1]},
    {"input_ids": [], "loss_mask": []},
    {"input_ids": [1, 2]},
    {"input_ids": 3, "loss_mask": 1},
])
def test_a_malformed_row_is_named_by_its_line(tmp_path, row):
    write(tmp_path, ROWS[:1])
    with open(tmp_path / "tokenized_data.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    with pytest.raises(UsageError, match=r"tokenized_data.jsonl:2: malformed row .*; rerun 01_prepare_dataset.py"):
        read_rows(str(tmp_path), 2)


def test_a_ragged_row_is_refused_in_the_readers_words_not_numpys(tmp_path):
    write(tmp_path, [([1, [2, 3]], [1, 1])])
    with pytest.raises(UsageError, match=r":1: malformed row \(input_ids and loss_mask must be equal-length lists"):
        read_rows(str(tmp_path), 1)
    with pytest.raises(ValueError, match="masks=True"):
        Rows.from_lists([([1], None)]).arrow_columns()


def test_true_in_a_text_field_does_not_slow_or_fail_a_row(tmp_path):
    """Only a line holding a literal true/false has each id's type looked at; such a line with only ints passes."""
    write(tmp_path, ROWS, {"note": "true", "flag": False})
    assert as_lists(read_rows(str(tmp_path), len(ROWS))) == ROWS


def test_the_arrow_table_is_the_one_datasets_builds_from_lists(tmp_path):
    """speculators reads stage 04's table: built from the arrays, it has the same types and rows as datasets' own
    from lists, chunked or not (chunks keep each int32 offset array under 2^31 tokens)."""
    import datasets
    from eagle3pipe.train import train_data
    rows = Rows.from_lists(ROWS)
    plain = datasets.Dataset.from_dict({"input_ids": [ids for ids, _ in ROWS], "loss_mask": [m for _, m in ROWS],
                                        "seq_len": [len(ids) for ids, _ in ROWS]})
    for chunk in (2 ** 30, 4, 1):
        table = datasets.Dataset.from_dict(rows[1:].arrow_columns(chunk), features=plain.features)
        assert table.features == plain.features and table.to_list() == plain.select(range(1, 4)).to_list(), chunk
    train_data.build_bridge(rows, str(tmp_path / "bridge"))
    built = datasets.load_from_disk(str(tmp_path / "bridge"))
    assert built.features == plain.features and built.to_list() == plain.to_list()


def test_same_ids_compares_lists_arrays_and_tensors():
    import torch
    ids = Rows.from_lists(ROWS)[0][0]
    assert same_ids([1, 2, 3], ids) and same_ids(torch.tensor([1, 2, 3]), ids) and same_ids(np.array([1, 2, 3]), ids)
    assert not same_ids([1, 2], ids) and not same_ids([1, 2, 4], ids) and not same_ids(None, ids)


def test_a_rows_digest_of_ids_is_the_same_for_its_view_a_list_and_a_tensor():
    """Stage 04 matches a file's token ids to its row by ids_digest: the row is an int32 view, the file's a list."""
    import torch
    from eagle3pipe.train.train_data import ids_digest
    ids = list(range(3, 100, 3))
    view = Rows.from_lists([([1], [1]), (ids, [1] * len(ids))])[1][0]
    assert ids_digest(view) == ids_digest(ids) == ids_digest(torch.tensor(ids))
    assert ids_digest(ids[:-1] + [7]) != ids_digest(view) and ids_digest([]) == ids_digest(np.array([], np.int32))
