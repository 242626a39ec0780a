"""Stage 01's rows as stages 02 and 04 hold them: read and checked once before any model loads, then kept compact.

A row is its token ids and loss mask. As Python lists they cost about 40 bytes a token (an int object and a list
slot each); a 500k-conversation run of 700M tokens would hold 28 GB in every process that reads them (stage 02's
parent, each of stage 04's torchrun ranks). Here all rows' ids sit in one int32 array and their masks in one uint8
array, 5 bytes a token, and row i is a pair of views into them:

    ids    [sum of lengths] int32     row i: ids[offsets[i]:offsets[i + 1]]
    masks  [sum of lengths] uint8     the same slice (None when the reader did not ask for masks)
    offsets [rows + 1]      int64     offsets[0] == 0 for a table read from disk; a slice keeps its parent's
"""
import array
import hashlib
import json
import os

import numpy as np

from ..base.errors import UsageError
from .files import STAGE_SCRIPTS, open_input

ID_LIMIT = 2 ** 31  # ids are held as int32; a vocabulary never comes near
SHAPE = "input_ids and loss_mask must be equal-length lists of integers (mask 0/1)"


class Rows:
    """[(input_ids, loss_mask)] of stage 01 as views into shared arrays (numpy int32 / uint8; the mask None when not
    asked for), and `digest`: the hash stage 01 recorded as its content_id. Indexing by a slice gives Rows again (no
    copy), so `rows[:n]` and `rows[cut:]` read as with a list."""

    __slots__ = ("ids", "masks", "offsets", "digest")

    def __init__(self, ids, masks, offsets, digest=None):
        self.ids, self.masks, self.offsets, self.digest = ids, masks, offsets, digest

    @classmethod
    def from_lists(cls, pairs, digest=None):
        """Rows from [(ids, mask or None)] held in memory (tests, small callers)."""
        pairs = list(pairs)
        lengths = [len(ids) for ids, _ in pairs]
        offsets = np.zeros(len(pairs) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter((x for i, _ in pairs for x in i), np.int32, int(offsets[-1]))
        has_masks = all(m is not None for _, m in pairs)
        masks = np.fromiter((x for _, m in pairs for x in m), np.uint8, int(offsets[-1])) if has_masks else None
        return cls(ids, masks, offsets, digest)

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("rows slices take no step")
            return Rows(self.ids, self.masks, self.offsets[start:max(start, stop) + 1], self.digest)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b], (None if self.masks is None else self.masks[a:b])

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def lengths(self):
        """[rows] int64: each row's token count."""
        return np.diff(self.offsets)

    @property
    def tokens(self):
        return int(self.offsets[-1] - self.offsets[0])

    def arrow_columns(self, chunk_tokens=2 ** 30):
        """{input_ids, loss_mask, seq_len} as Arrow columns (list<int32>, list<int64>, int64: the types datasets infers
        from Python lists, so the table speculators reads is unchanged), straight from the arrays with no Python int
        per token. Chunked so that no chunk's int32 offsets pass 2^31 tokens."""
        import pyarrow as pa
        if self.masks is None:
            raise ValueError("the Arrow table holds the masks: read the rows with masks=True")
        cols = {"input_ids": [], "loss_mask": [], "seq_len": []}
        start = 0
        while start < len(self):
            base = int(self.offsets[start])
            stop = max(start + 1, int(np.searchsorted(self.offsets, base + chunk_tokens, "right")) - 1)
            stop = min(stop, len(self))
            span, end = self.offsets[start:stop + 1], int(self.offsets[stop])
            offsets = pa.array((span - base).astype(np.int32))
            cols["input_ids"].append(pa.ListArray.from_arrays(offsets, pa.array(self.ids[base:end])))
            cols["loss_mask"].append(pa.ListArray.from_arrays(offsets, pa.array(self.masks[base:end].astype(np.int64))))
            cols["seq_len"].append(pa.array(np.diff(span)))
            start = stop
        types = {"input_ids": pa.list_(pa.int32()), "loss_mask": pa.list_(pa.int64()), "seq_len": pa.int64()}
        return {k: pa.chunked_array(v, types[k]) for k, v in cols.items()}

    def token_ids(self):
        """[row's ids view] for every row: what stage 02 feeds the verifier."""
        return [self.ids[int(a):int(b)] for a, b in zip(self.offsets[:-1], self.offsets[1:])]


def same_ids(stored, ids):
    """A file's token ids (list, array or tensor; None when unreadable) against a row's."""
    return stored is not None and len(stored) == len(ids) and np.array_equal(np.asarray(stored), np.asarray(ids))


def _checked(line, r, vocab_size):
    """-> (ids int32, mask uint8) of one parsed line, or ValueError saying what is wrong with it."""
    ids, mask = r["input_ids"], r["loss_mask"]
    if not (isinstance(ids, list) and isinstance(mask, list) and len(ids) == len(mask) > 0):
        raise ValueError(SHAPE)
    try:
        a, m = np.array(ids), np.array(mask)
    except ValueError:  # ragged nesting: numpy's own words name no row
        raise ValueError(SHAPE) from None
    # numpy reads a JSON true among integers as 1: only a line holding a literal true/false looks at each id's type
    if a.ndim != 1 or m.ndim != 1 or a.dtype.kind not in "iu" or m.dtype.kind not in "iub" or \
            ((b"true" in line or b"false" in line) and any(type(x) is not int for x in ids)):
        raise ValueError(SHAPE)
    if not ((m == 0) | (m == 1)).all():
        raise ValueError(SHAPE)
    limit = ID_LIMIT if vocab_size is None else vocab_size
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= limit:
        raise ValueError(f"token ids must be in [0, {limit}), got {lo}..{hi}")
    return a.astype(np.int32), m.astype(np.uint8)


def read_rows(folder, expected, vocab_size=None, masks=True, longest=None):
    """Stage 01's rows as Rows, each checked before any model loads (a hand edit that breaks a row is named by its
    line): token ids are integers (inside the verifier's vocabulary when `vocab_size` is given), masks 0/1 of equal
    length; `expected`: the row count stage 01's manifest gives; `longest`: its longest row, which stage 02's
    --max-seq-len and memory plan were checked against."""
    path, h = os.path.join(folder, "tokenized_data.jsonl"), hashlib.sha256()
    rerun = f"rerun {STAGE_SCRIPTS['prepare']}"
    # grown in place (amortised), then viewed by numpy without a copy
    ids_buf, mask_buf, lengths = array.array("i"), array.array("B"), array.array("q", [0])
    try:
        f = open_input(path, "rb")
    except OSError as e:
        raise UsageError(f"--prepared-data {folder}: cannot read tokenized_data.jsonl ({e.strerror}); {rerun}")
    with f:
        for lineno, line in enumerate(f, 1):
            h.update(line)
            try:
                ids, mask = _checked(line, json.loads(line), vocab_size)
            except (ValueError, KeyError, TypeError, RecursionError) as e:
                raise UsageError(f"{path}:{lineno}: malformed row ({' '.join(str(e).split())[:120]}); {rerun}")
            ids_buf.frombytes(ids.tobytes())
            if masks:
                mask_buf.frombytes(mask.tobytes())
            lengths.append(len(ids))
    offsets = np.cumsum(np.frombuffer(lengths, np.int64))
    rows = Rows(np.frombuffer(ids_buf, np.int32), np.frombuffer(mask_buf, np.uint8) if masks else None, offsets)
    if len(rows) != expected:
        raise UsageError(f"{path}: {len(rows)} rows, its manifest says {expected}; {rerun}")
    if longest is not None and len(rows) and int(rows.lengths().max()) != longest:
        at = int(rows.lengths().argmax())
        raise UsageError(f"{path}: its longest row (line {at + 1}) has {len(rows[at][0])} tokens, its manifest says "
                         f"{longest}; {rerun}")
    rows.digest = h.hexdigest()[:16]
    return rows
