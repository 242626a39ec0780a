"""Stage 04's data: the cross-stage checks of its three inputs, the first N rows, the split, the offline hidden-state
files read through a checked transfer (a bad sample skipped and counted), and stage 01's rows as the Arrow table
speculators reads (the bridge; online runs build it too, with the engine's address). Hidden states are never copied:
speculators' `hidden_states_path` points at stage 02's folder, row i <-> hs_i.
"""
import array
import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from ..adapters import loader_dataset, register_backend
from ..base.errors import RunError, UsageError
from ..formats import fp8_transport
from ..formats.hidden_states import SCALES, check_header, fp8_to, hs_path, load_sample, read_token_ids, verify_crc
from ..storage import files, outdir
from ..storage.files import STAGE_SCRIPTS, load_stage, content_id, load_npy
from ..storage.rows import read_rows, same_ids
from ..verifier.verifier import same_verifier

log = logging.getLogger("eagle3")


@dataclasses.dataclass(frozen=True)
class States:
    """What stage 04 trains on besides the rows: stage 02's folder (read from its manifest) or an --online engine's
    states (described by the run's own flags, no folder)."""
    layer_ids: tuple      # the verifier's layer ids stored per token; the last, n, is its last hidden state
    hidden_size: int
    storage_dtype: str    # bf16 or fp8 (with scales) as stored; online engines hand over bf16
    content_id: str       # part of the run's identity: another extraction is another run
    failed: frozenset = frozenset()  # rows stage 02 could not extract: no file
    online: bool = False
    scale_max: Optional[float] = None  # fp8: the largest per-token scale stage 02 wrote (its manifest's record)

    @classmethod
    def from_manifest(cls, m):
        return cls(tuple(m["layer_ids"]), m["verifier"]["hidden_size"], m.get("storage_dtype", "bf16"),
                   m["content_id"], frozenset(int(i) for i in m.get("failures", {})),
                   scale_max=_scale_max(m.get("fp8_scale_max")))

    @property
    def aux(self):
        return list(self.layer_ids[:-1])  # the draft's inputs


def _scale_max(value):
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                  and math.isfinite(value) and value > 0):
        raise UsageError(f"--hidden-states: manifest.json: field 'fp8_scale_max' is {value!r:.40}, expected a positive "
                         f"number (stage 02's largest fp8 scale); rerun {STAGE_SCRIPTS['extract']} --verify")
    return value


DATASET_FILES = r"data-\d+-of-\d+\.arrow|dataset_info\.json|state\.json|\.done"  # datasets' save_to_disk, and ours


def _mismatch(what, a_name, a, b_name, b, rerun):
    diff = same_verifier(a, b)
    if diff:
        raise UsageError(f"{what}: {a_name} and {b_name} come from different verifiers ({diff}: {a.get(diff)} vs "
                         f"{b.get(diff)}); rerun {STAGE_SCRIPTS[rerun]}")


def check_inputs(args, fp, verify_data=True, online_layer_ids=None):
    """All cross-stage checks, before torch: -> (prep manifest, States, vocab manifest, rows [(ids, mask)], failed
    rows). With --online (`online_layer_ids`) there is no stage 02 folder: States describes what the engine makes."""
    prep = load_stage("--prepared-data", args.prepared_data, "prepare")
    voc = load_stage("--vocab-mapping", args.vocab_mapping, "vocab")
    if online_layer_ids:
        states = States(tuple(online_layer_ids), fp["hidden_size"], "bf16",
                        "online-" + content_id([online_layer_ids, prep["content_id"]]), online=True)
    else:
        ext = load_stage("--hidden-states", args.hidden_states, "extract")
        _mismatch("--hidden-states", "stage 01", prep["verifier"], "stage 02", ext["verifier"], "extract")
        if ext["identity"]["prepared"] != prep["content_id"] or ext["counts"]["rows"] != prep["counts"]["rows"]:
            raise UsageError(f"--hidden-states {args.hidden_states}: extracted from another stage 01 run than "
                             f"--prepared-data {args.prepared_data}; rerun {STAGE_SCRIPTS['extract']}")
        if args.layer_ids and list(args.layer_ids) + [fp["num_hidden_layers"]] != ext["layer_ids"] and \
                list(args.layer_ids) != ext["layer_ids"]:
            raise UsageError(f"--layer-ids {args.layer_ids}: stage 02 extracted {ext['layer_ids'][:-1]} into "
                             f"--hidden-states {args.hidden_states}; give those, or rerun {STAGE_SCRIPTS['extract']}")
        states = States.from_manifest(ext)
    _mismatch("--prepared-data", "--model-path", fp, "stage 01", prep["verifier"], "prepare")
    _mismatch("--vocab-mapping", "stage 01", prep["verifier"], "stage 03", voc["verifier"], "vocab")
    import numpy as np
    d2t_path, t2d_path = (os.path.join(args.vocab_mapping, n) for n in ("d2t.npy", "t2d.npy"))
    try:
        d2t, t2d = load_npy(d2t_path), load_npy(t2d_path)
    except (OSError, ValueError) as e:
        raise UsageError(f"--vocab-mapping {args.vocab_mapping}: unreadable d2t/t2d ({e}); rerun 03_build_vocab_mapping.py")
    k, v = voc["counts"]["draft_vocab_size"], fp["vocab_size"]
    if d2t.shape != (k,) or t2d.shape != (v,) or int(t2d.sum()) != k or \
            not np.array_equal(np.arange(k) + d2t, np.flatnonzero(t2d)):
        raise UsageError(f"--vocab-mapping {args.vocab_mapping}: d2t {list(d2t.shape)} / t2d {list(t2d.shape)} do not "
                         f"form a {k}-of-{v} mapping; rerun 03_build_vocab_mapping.py")
    if "d2t_id" in voc and files.array_id(d2t) != voc["d2t_id"]:  # t2d is checked against d2t just above
        raise UsageError(f"--vocab-mapping {args.vocab_mapping}: d2t.npy changed since stage 03 wrote it (content id "
                         f"{files.array_id(d2t)}, its {files.MANIFEST} says {voc['d2t_id']}); rerun "
                         f"03_build_vocab_mapping.py")
    rows = read_rows(args.prepared_data, prep["counts"]["rows"])
    if online_layer_ids:
        if rows.digest != prep["content_id"]:
            raise UsageError(f"--prepared-data {args.prepared_data}: tokenized_data.jsonl was edited after stage 01 "
                             f"wrote it (its hash is not the manifest's content_id); rerun {STAGE_SCRIPTS['prepare']}")
        return prep, states, voc, rows, set()
    n_states, hidden, failed = len(states.layer_ids), states.hidden_size, set(states.failed)
    if rows.digest != prep["content_id"]:
        changed = next((i for i, (ids, _) in enumerate(rows)
                        if i not in failed and not same_ids(_stored_ids(args, i), ids)), None)
        where = (f"row {changed} (line {changed + 1}) differs from the tokens stage 02 extracted into "
                 f"hs_{changed}.safetensors" if changed is not None else "its hash is not the manifest's content_id")
        raise UsageError(f"--prepared-data {args.prepared_data}: tokenized_data.jsonl was edited after stage 01 wrote "
                         f"it ({where}); rerun {STAGE_SCRIPTS['prepare']}, then the later stages")
    bad = []
    for i, n in enumerate(rows.lengths().tolist()):
        if i in failed:
            continue
        reason = check_header(hs_path(args.hidden_states, i), n, n_states, hidden)
        if reason:
            bad.append((i, reason))
    if not bad and verify_data:  # --verify-data: every byte against its CRC before step 1 (else as each is read)

        def verify(i):
            reason = verify_crc(hs_path(args.hidden_states, i))
            if reason:
                return reason
            return None if same_ids(_stored_ids(args, i), rows[i][0]) else "token_ids differ from the prepared row"
        todo = [i for i in range(len(rows)) if i not in failed]
        with ThreadPoolExecutor(min(16, 2 * (os.cpu_count() or 1))) as ex:
            bad = [(i, r) for i, r in zip(todo, ex.map(verify, todo)) if r]
    if bad:
        i, reason = bad[0]
        raise UsageError(f"--hidden-states {args.hidden_states}: {len(bad)} bad file(s), e.g. hs_{i}.safetensors: "
                         f"{reason}; move the bad files away, then rerun {STAGE_SCRIPTS['extract']} with its flags (it "
                         f"makes only the missing ones again)")
    return prep, states, voc, rows, failed


_checked = [None]  # the transfer install_checked registered
CHECKED = "eagle3pipe-checked"  # our transfer's name in speculators' backend registry


MAX_BAD_SHARE = 0.01  # of the rows: more bad samples than this (and more than one) stop the run


def ids_digest(ids):
    """A row's token ids in one int: its length and 17 ids spread over it. A file holding another row's states
    (copied or renamed over this one) differs here; two rows that agree on all of it are alike enough to train on."""
    n = len(ids)
    picked = ids[::max(1, n // 16)]  # a row's int32 view or a file's list: the same ints either way
    return hash((n, tuple(int(x) for x in picked), int(ids[-1]) if n else None))


class CheckedFiles:
    """speculators' HiddenStatesTransfer for offline training: stage 02's files, each read once and checked where it
    is read (hidden_states.load_sample: header, dtypes, CRC-32, finite values), not in a pass over every byte before
    step 1. A bad sample is skipped and logged in logs/skipped.jsonl; more than MAX_BAD_SHARE of the rows (and more
    than one) stop the run with one line. Picklable: data-loader workers get a copy."""

    def __init__(self, folder, n_states, hidden, skipped_log, rows, dtype="bfloat16", failed=(), packed=False,
                 digests=None, scale_max=None):
        self.folder, self.n_states, self.hidden, self.skipped_log = folder, n_states, hidden, skipped_log
        self.rows, self.dtype, self.failed, self.packed = rows, dtype, frozenset(failed), packed
        self.digests = digests  # array('q') of ids_digest per row: a file must hold its own row's tokens
        self.scale_max = scale_max  # fp8: no file's scale above the largest stage 02 wrote

    def __setstate__(self, state):
        self.__dict__.update(state)
        outdir.attach(os.path.dirname(os.path.dirname(self.skipped_log)))  # a spawned worker logs into our record

    def setup(self):
        pass

    def get_cached(self, file_idx):
        path = hs_path(self.folder, int(file_idx))
        if not os.path.lexists(path):
            if int(file_idx) not in self.failed:  # stage 02 wrote it: gone since, a bad sample like any other
                self.skip(int(file_idx), "missing (deleted since stage 02 wrote it)")
            return None  # a row stage 02 could not extract: speculators skips it
        reason, t = load_sample(path, self.n_states, self.hidden, self.scale_max)
        if not reason and self.digests is not None and ids_digest(t["token_ids"].tolist()) != self.digests[int(file_idx)]:
            reason = "its token_ids are not this row's (another sample's file copied or renamed over it?)"
        if reason:
            self.skip(int(file_idx), reason)
            return None
        states = t["hidden_states"]  # [T, L+1, H]
        if self.packed:  # fp8 on disk: its bytes go on, dequantized on the GPU (fp8_transport.py)
            if SCALES not in t:  # the batch is collated as fp8 bytes: another dtype cannot join it
                self.skip(int(file_idx), f"{states.dtype} states in an fp8 folder (stage 02 wrote fp8 with scales)")
                return None
            states = fp8_transport.pack(states, t[SCALES])  # uint8 [T, L+1, H+4]
        elif SCALES in t:  # the trainer sees the compute dtype, as speculators' FP8Transfer computes it
            import torch
            states = fp8_to(states, t[SCALES], getattr(torch, self.dtype))
        return {"hidden_states": states, "token_ids": t["token_ids"]}

    def get_generated(self, params):
        return None

    def delete(self, handle):
        pass  # stage 02's files are its own: training never deletes them

    def skip(self, i, reason):
        log.warning(f"hs_{i}.safetensors: {reason}; sample skipped")
        fd = outdir.open_append(self.skipped_log)
        try:
            os.write(fd, (json.dumps({"row": i, "reason": reason[:300], "time": time.time()}) + "\n").encode())
        finally:
            os.close(fd)
        with open(self.skipped_log, encoding="utf-8") as f:
            n = len({json.loads(line)["row"] for line in f if line.strip()})
        if n > max(1, MAX_BAD_SHARE * self.rows):
            raise RunError(f"--hidden-states {self.folder}: {n} of {self.rows} samples are bad (e.g. hs_{i}.safetensors: "
                           f"{reason}), more than {MAX_BAD_SHARE:.0%}; move the bad files away (logs/skipped.jsonl "
                           f"names them), rerun {STAGE_SCRIPTS['extract']} (it makes only the missing ones again), then "
                           f"this command")


def skipped_rows(out):
    """How many samples CheckedFiles skipped in this folder's runs (logs/skipped.jsonl)."""
    try:
        with open(os.path.join(out, "logs", files.SKIPPED), encoding="utf-8") as f:
            return len({json.loads(line)["row"] for line in f if line.strip()})
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def install_checked(transfer):
    """Make `transfer` what speculators' loaders read offline, through its public registry."""
    from hs_connectors.transfer import HiddenStatesTransfer
    HiddenStatesTransfer.register(CheckedFiles)  # an ABC: ours is a virtual subclass
    _checked[0] = transfer
    register_backend(CHECKED, lambda: _checked[0])


class OfflineData:
    """Stage 02's files, entered around training like online.Session: rank 0 writes the training table, every rank
    waits for it and registers the checked transfer (each sample checked where it is read: CRC, dtype, finite
    values). `loaders()`: speculators' own; `summary()`: the samples skipped."""

    def __init__(self, args, states, out, rank, rows, bridge, dtype):
        self.args, self.states, self.out, self.rank, self.rows, self.bridge, self.dtype = \
            args, states, out, rank, rows, bridge, dtype
        self.url = None

    def __enter__(self):
        if self.rank == 0:
            build_bridge(self.rows, self.bridge)
        wait_for_bridge(self.bridge)
        install_checked(CheckedFiles(os.path.abspath(self.args.hidden_states), len(self.states.layer_ids),
                                     self.states.hidden_size, os.path.join(self.out, "logs", files.SKIPPED),
                                     len(self.rows), self.dtype, set(self.states.failed), packed=self.fp8,
                                     digests=array.array("q", (ids_digest(ids) for ids, *_ in self.rows)),
                                     scale_max=self.states.scale_max))
        return self

    def __exit__(self, *exc):
        pass

    @property
    def fp8(self):
        return self.states.storage_dtype == "fp8"

    def loaders(self):
        """fp8: speculators' loaders collate the stored bytes (fp8_transport.py); bf16: as they are."""
        if not self.fp8:
            return None
        return loader_dataset(fp8_transport.dataset_class())

    def batch_step(self, device):
        """What the training process does to each batch before the trainer sees it (fp8: moved to `device` and
        dequantized there), or None."""
        if not self.fp8:
            return None
        return fp8_transport.Unpack(device, len(self.states.aux), self.states.hidden_size, self.dtype)

    def summary(self):
        return {"skipped_samples": skipped_rows(self.out)}


def first_rows(args, rows, failed):
    """--num-samples N: the first N rows (row i stays hs_i, so stage 02's folder serves any N). -> (rows, failed)."""
    n = args.num_samples
    if n is None:
        return rows, failed
    if n > len(rows):
        raise UsageError(f"--num-samples {n}: --prepared-data {args.prepared_data} holds {len(rows)} rows; give at "
                         f"most {len(rows)}, or leave it out to train on all of them")
    return rows[:n], {i for i in failed if i < n}


def check_split(rows, val_ratio, failed=(), hidden_states=None):
    """speculators splits the rows at int(rows x (1 - val_ratio)): both sides must hold a row, and a row stage 02
    extracted (`failed`: the rows it could not; their batches would come out empty mid-run)."""
    cut = int(rows * (1 - val_ratio))
    if not 0 < cut < rows:
        raise UsageError(f"--val-ratio {val_ratio}: of {rows} rows it leaves {cut} to train on and {rows - cut} to "
                         f"validate; both need at least one (more rows, or another ratio)")
    for side, span in (("training", range(cut)), ("validation", range(cut, rows))):
        if all(i in failed for i in span):
            raise UsageError(f"--hidden-states {hidden_states}: stage 02 extracted none of the {len(span)} {side} rows "
                             f"(rows {span.start}-{span.stop - 1} all failed: its log says why); rerun "
                             f"02_extract_hidden_states.py")


def _stored_ids(args, i):
    try:
        return read_token_ids(hs_path(args.hidden_states, i))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def build_bridge(rows, folder, engine_url=None):
    """Stage 01's rows as the Arrow table speculators' ArrowDataset reads. Row order is kept: row i <-> hs_i.
    Rows whose extraction failed stay in the table (their file is absent: speculators skips them). With --online the
    engine's URL goes beside it, for the other ranks. Built in `<folder>.new` (made and recorded here) and renamed."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable
    # from the rows' arrays straight into Arrow (no Python int per token: a 500k-row run would hold tens of GB), with
    # the column types datasets infers from Python lists. Given no fingerprint, datasets pickles the whole table to
    # hash it (a second copy of every token: +1.2 GB at the embedded data's 25M tokens); the rows' own digest and
    # span name the table instead
    span = f"{rows.digest}:{int(rows.offsets[0])}:{int(rows.offsets[-1])}:{len(rows)}"
    ds = datasets.Dataset(InMemoryTable(pa.table(rows.arrow_columns())),
                          fingerprint=hashlib.sha256(span.encode()).hexdigest()[:32])
    ds.set_format(type="torch")
    new = outdir.make_dir(folder + ".new")
    outdir.clear_scratch(new, DATASET_FILES)  # a killed run's half-built table
    ds.save_to_disk(new)
    with open(os.path.join(new, ".done"), "w") as f:  # a fresh file in a folder this stage just filled
        f.write(engine_url or "")
    outdir.record_tree(new)
    outdir.replace_dir(new, folder)


def wait_for_bridge(folder, timeout=600):
    """-> the engine URL rank 0 wrote (--online), else ''. Rank 0 may spend a long time starting the engine first."""
    deadline = time.time() + timeout
    while not os.path.exists(os.path.join(folder, ".done")):
        if time.time() > deadline:
            raise RuntimeError(f"rank 0 did not build {folder} in {timeout} s")
        time.sleep(0.5)
    with open(os.path.join(folder, ".done")) as f:
        return f.read().strip()
