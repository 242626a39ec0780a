"""Verifier vocab -> draft vocab: the K most frequent loss-masked verifier tokens.

`t2d` bool [V]: True where a verifier token is in the draft vocab. `d2t` int64 [K]: draft id i maps to
verifier id i + d2t[i] (the offset form vLLM and speculators use). Selection: top-K by loss-masked count,
ties to the lower id; when fewer than K tokens ever occur, padded with the lowest unused ids; the chosen
ids sorted ascending, so draft ids keep the verifier's order.
"""
import numpy as np

from ..base.errors import UsageError


def build_mapping(freq, k):
    """freq: int64 [V] loss-masked counts -> (d2t int64 [K], t2d bool [V], coverage in [0, 1])."""
    freq = np.asarray(freq, dtype=np.int64)
    v = freq.shape[0]
    if k < 1 or k > v:
        raise UsageError(f"--draft-vocab-size {k}: must be between 1 and the verifier vocab size {v}")
    total = int(freq.sum())
    if total <= 0:
        raise UsageError("token_freq.npy counts no loss-masked token; rerun 01_prepare_dataset.py with data "
                         "that has assistant turns")
    order = np.lexsort((np.arange(v), -freq))  # by count descending, then id ascending
    n_used = int((freq > 0).sum())
    chosen = order[: min(k, n_used)]
    if chosen.size < k:
        unused = np.flatnonzero(freq == 0)[: k - chosen.size]
        chosen = np.concatenate([chosen, unused])
    chosen = np.sort(chosen)
    d2t = (chosen - np.arange(k)).astype(np.int64)
    t2d = np.zeros(v, dtype=bool)
    t2d[chosen] = True
    coverage = float(freq[chosen].sum()) / total
    return d2t, t2d, coverage
