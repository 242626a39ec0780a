"""Vocab-map semantics: target = i + d2t[i], top-K by count, ties to the lower id, padding, coverage."""
import numpy as np
import pytest

from eagle3pipe.config.cli import UsageError
from eagle3pipe.prepare.vocab import build_mapping



def test_topk_ties_and_offsets():
    freq = np.array([0, 5, 3, 5, 0, 1, 3, 0], dtype=np.int64)
    d2t, t2d, coverage = build_mapping(freq, 4)
    target = np.arange(4) + d2t
    # counts 5,5 (ids 1,3) then 3,3 (ids 2,6): the tie at 3 goes to the lower id... both fit; K=3 decides it
    assert target.tolist() == [1, 2, 3, 6]
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_
    assert np.flatnonzero(t2d).tolist() == [1, 2, 3, 6]
    assert coverage == pytest.approx(16 / 17)
    d2t, t2d, _ = build_mapping(freq, 3)
    assert (np.arange(3) + d2t).tolist() == [1, 2, 3]  # 2 and 6 tie at 3: the lower id wins


def test_padding_with_lowest_unused_ids():
    freq = np.array([0, 0, 7, 0, 2, 0], dtype=np.int64)
    d2t, t2d, coverage = build_mapping(freq, 4)
    assert (np.arange(4) + d2t).tolist() == [0, 1, 2, 4]
    assert t2d.sum() == 4 and coverage == 1.0


def test_sorted_ascending_and_consistent():
    rng = np.random.default_rng(0)
    freq = rng.integers(0, 50, size=1000)
    d2t, t2d, _ = build_mapping(freq, 100)
    target = np.arange(100) + d2t
    assert np.all(np.diff(target) > 0)
    assert np.array_equal(np.flatnonzero(t2d), target)
    # every chosen token is at least as frequent as every token left out
    assert freq[target].min() >= freq[~t2d].max()


def test_refusals():
    with pytest.raises(UsageError, match="between 1 and"):
        build_mapping(np.ones(10, dtype=np.int64), 11)
    with pytest.raises(UsageError, match="no loss-masked token"):
        build_mapping(np.zeros(10, dtype=np.int64), 5)
