"""Stage 04 --online, the data side: what speculators' loaders read. `CacheTransfer` hands the dataset the samples
`OnlineArrowDataset` fetched (a packed batch's samples at once) and keeps generated files in a bounded cache
folder of stage 02's format (`--cache-gb`, its count under a lock), else deletes them once read."""
import fcntl
import json
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..adapters import loader_dataset, original, register_backend, interrupted
from ..base.errors import RunError
from ..base.faults import nan_rows
from ..base.lifeline import parent_death_signal
from ..formats.hidden_states import HS_NAME, hs_path, load_checked, read_header, save
from ..formats.spool import clear_spool, wait_for_engine_file, remove_spool_file
from ..storage import locks, outdir
from ..storage.files import SKIPPED, atomic_path

log = logging.getLogger("eagle3")

SPOOL = ".online"                 # the engine's files, each deleted (or moved into the cache) once read
CACHE = "hidden_states_cache"     # --cache-gb: kept samples, stage 02's format (hs_{i}.safetensors)
BACKEND = "eagle3pipe-online"     # the name our transfer is registered under in speculators' backend registry


def worker_init(worker_id):
    """speculators' data-loader worker setup, plus: die with stage 04. A worker blocked in a request to the engine
    would otherwise outlive a killed run for the request's timeout, holding its connection open, and the engine
    (which on SIGTERM waits for its connections to close) with it."""
    import speculators.train.dataloader as sdl
    parent_death_signal(signal.SIGKILL)
    if os.getppid() == 1:  # the parent was gone before the line above
        os._exit(1)
    original(sdl, "_worker_init_fn")(worker_id)  # a forked worker inherits the patch; a spawned one has the original


class CacheTransfer:
    """speculators' HiddenStatesTransfer for --online: hands the dataset the samples `OnlineArrowDataset` fetched,
    and keeps generated files in `cache_dir` while the budget allows. Picklable (data-loader workers are spawned)."""

    def __init__(self, cache_dir, budget_bytes, skipped_log, concurrency, n_states, hidden, nan_rows=(), spool=None):
        self.cache_dir, self.budget, self.skipped_log, self.spool = cache_dir, budget_bytes, skipped_log, spool
        self.n_states, self.hidden = n_states, hidden
        self.concurrency, self.nan_rows = concurrency, set(nan_rows)
        self.ready, self.local = {}, None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("ready", "local")}

    def __setstate__(self, state):
        self.__dict__.update(state, ready={}, local=None)
        outdir.attach(os.path.dirname(self.cache_dir))  # a spawned worker records what it caches in stage 04's record

    def _index(self):
        return getattr(self.local, "index", None) if self.local else None

    def setup(self):
        pass

    def get_cached(self, file_idx):
        return self.ready.pop(int(file_idx), None)

    def from_cache(self, file_idx, token_ids):
        """A cached sample {hidden_states, token_ids} after the full check (CRC, token ids, finite), or None; a bad
        file is deleted (it will be generated again)."""
        if not self.budget:
            return None
        path = hs_path(self.cache_dir, file_idx)
        if not os.path.exists(path):
            return None
        reason, tensors = load_checked(path, token_ids, self.n_states, self.hidden)
        if reason:
            log.warning(f"{path}: {reason}; generating it again")
            self._release(path)
            return None
        return {"hidden_states": tensors["hidden_states"], "token_ids": tensors["token_ids"]}

    def get_generated(self, params):
        from safetensors.torch import load_file
        path = params.get("hidden_states_path") or params.get("handle")
        if not wait_for_engine_file(path, self.spool):
            raise RunError(f"the engine named {outdir.quote(path)}, outside the spool {self.spool}; nothing there is "
                           f"read or deleted")
        tensors = load_file(path)
        if self._index() in self.nan_rows:  # fault injection: poison what speculators' check then sees
            tensors["hidden_states"] = tensors["hidden_states"].clone()
            tensors["hidden_states"].view(-1)[0] = float("nan")
        return tensors

    def delete(self, handle):
        """After speculators has checked the sample: keep it in the cache if it fits, else delete it."""
        i = self._index()
        if not outdir.confined(self.spool, handle):
            return  # not the engine's file in our spool: never deleted
        if i is None or not self.budget or not self._keep(handle, i):
            remove_spool_file(self.spool, handle)

    def _keep(self, path, i):
        dest, size = hs_path(self.cache_dir, i), os.path.getsize(path)
        with _BudgetLock(self.cache_dir) as b:
            if b.used + size > self.budget or os.path.exists(dest):
                return False
            b.used += size
        if "crc32" in (read_header(path)[0].get("__metadata__") or {}):
            outdir.install(path, dest)  # our CPU connector's or hf_server's file: already stage 02's format
        else:  # vLLM's GPU connector writes no checksum: rewrite it with one
            from safetensors.torch import load_file
            save(dest, load_file(path))
            remove_spool_file(self.spool, path)
        return True

    def _release(self, path):
        with _BudgetLock(self.cache_dir) as b:
            try:
                size = os.path.getsize(path)
                if not outdir.remove(path):
                    b.used = max(0, b.used - size)
            except FileNotFoundError:
                pass

    def skipped(self, file_idx, reason):
        line = json.dumps({"row": int(file_idx), "reason": reason[:300], "time": time.time()}) + "\n"
        fd = outdir.open_append(self.skipped_log)
        try:
            os.write(fd, line.encode())  # one write with O_APPEND: lines of concurrent workers never interleave
        finally:
            os.close(fd)


class _BudgetLock:
    """The cache's used bytes in `.used`, changed under an flock shared by every worker process."""

    def __init__(self, folder):
        self.path = os.path.join(folder, ".used")

    def __enter__(self):
        self.fd = outdir.open_append(self.path + ".lock", os.O_RDWR)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd) as f:
                self.used = self.before = int(f.read(32).strip() or 0)
        except (OSError, ValueError):
            self.used = self.before = 0
        return self

    def __exit__(self, *exc):
        try:
            if self.used != self.before:
                with atomic_path(self.path) as tmp, open(tmp, "w") as f:
                    f.write(str(self.used))
        finally:
            os.close(self.fd)


def prepare_cache(cache_dir, budget_bytes):
    """Rank 0, before training: the cache's files re-counted (a killed run may have left the count behind) and files
    over a smaller budget than last time dropped; only files the record says this stage made count, or are deleted
    (a killed writer's temporary files went when the folder was claimed). -> (files, bytes)."""
    outdir.make_dir(cache_dir)
    names, used = [], 0
    for e in sorted(os.scandir(cache_dir), key=lambda e: e.name):
        if e.name[3:-12].isdigit() and e.name == HS_NAME.format(int(e.name[3:-12])) and outdir.owned(e.path):
            names.append((int(e.name[3:-12]), e))
    kept = 0
    for i, e in sorted(names):
        size = e.stat().st_size
        if used + size > budget_bytes:
            outdir.remove(e.path)
        else:
            used, kept = used + size, kept + 1
    with _BudgetLock(cache_dir) as b:
        b.used = used
        b.before = -1  # always write the count
    return kept, used


def dataset_class():
    """speculators' ArrowDataset with a packed batch's samples fetched together (cache first, then all missing ones
    concurrently from the engine). Defined on first use: speculators imports torch."""
    global OnlineArrowDataset
    if "OnlineArrowDataset" in globals():
        return OnlineArrowDataset

    from speculators.train.data import ArrowDataset, build_client_item
    from speculators.train.recovery import SampleUnavailable

    class OnlineArrowDataset(ArrowDataset):
        def __getitems__(self, indices):
            t = self.transfer
            if t.local is None:
                t.local = threading.local()
            missing = []
            for index in indices:
                fi = int(self._map_to_file_idx(index))  # the sampler's indices are numpy integers
                got = t.from_cache(fi, self.data[index]["input_ids"].tolist())
                if got is None:
                    missing.append(index)
                else:
                    t.ready[fi] = got
            if missing:
                if self.client is None:
                    try:
                        self._setup_client()
                    except Exception as e:  # noqa: BLE001 - each sample's own attempts below report it
                        if interrupted(e):
                            raise
                with ThreadPoolExecutor(min(len(missing), t.concurrency)) as ex:
                    for index, res in zip(missing, ex.map(self._generate, missing)):
                        t.ready[int(self._map_to_file_idx(index))] = res
            return [self[i] for i in indices]

        def _generate(self, index):
            t, fi = self.transfer, int(self._map_to_file_idx(index))
            t.local.index = fi
            item = self.data[index]
            res = self.generation_recovery.run(
                lambda: self._generate_hidden_states_once(item, build_client_item(item)),
                description=f"row {fi}: hidden-state generation failed")
            if isinstance(res, SampleUnavailable):
                t.skipped(fi, res.reason)
            return res

    OnlineArrowDataset.__module__ = __name__
    OnlineArrowDataset.__qualname__ = "OnlineArrowDataset"
    return OnlineArrowDataset


def __getattr__(name):  # a spawned data-loader worker unpickling the dataset finds the class here
    if name == "OnlineArrowDataset":
        return dataset_class()
    raise AttributeError(name)


def install(out, p, url):
    """Register our transfer with speculators (its public registry). -> the transfer."""
    from hs_connectors.transfer import HiddenStatesTransfer
    cache_dir, logs = os.path.join(out, CACHE), os.path.join(out, "logs")
    transfer = CacheTransfer(cache_dir, p.cache_bytes, os.path.join(logs, SKIPPED), 64, p.n_states, p.hidden_size,
                             nan_rows(), spool=spool_of(out, p))
    HiddenStatesTransfer.register(CacheTransfer)  # an ABC: ours is a virtual subclass
    _transfer[0] = transfer
    register_backend(BACKEND, lambda: _transfer[0])
    return transfer


_transfer = [None]


def loaders():
    """For training.run: speculators' loaders build OnlineArrowDataset and start workers with worker_init."""
    return loader_dataset(dataset_class(), worker_init)


def summary(out, p):
    """For stage 04's manifest: the mode, the cache's state and the samples skipped."""
    skipped = set()
    try:
        with open(os.path.join(out, "logs", SKIPPED)) as f:
            skipped = {json.loads(line)["row"] for line in f if line.strip()}
    except (OSError, ValueError, KeyError):
        pass
    cache = os.path.join(out, CACHE)
    names = [n for n in os.listdir(cache) if n.startswith("hs_")] if os.path.isdir(cache) else []
    return {"mode": "cached" if p.cache_bytes else "online", "engine": p.address or "started by stage 04",
            "cache_budget_bytes": p.cache_bytes, "cache_files": len(names),
            "cache_bytes": sum(os.path.getsize(os.path.join(cache, n)) for n in names),
            "skipped_samples": len(skipped)}


def spool_of(out, p):
    """The one folder an engine's answers are used in: `<output-dir>/.online` for the engine stage 04 starts (it
    writes into `.online/<pid>`), or the --engine-spool an engine at --engine-address writes to."""
    return p.spool or os.path.join(out, SPOOL)


def prepare(out, p):
    """Rank 0, before the engine starts and before the other ranks read anything: the spool emptied of engine files
    (it holds only files in flight: a killed run's are stale; anything else there stays), the cache recounted, logs/
    made. -> the folder the engine writes to. For an engine stage 04 starts: `.online/<pid>`, fresh (what engines
    of dead runs left in theirs goes, told by its format: spool.clear_spool). An --engine-spool is never cleared:
    only the files that engine hands back are deleted, once read."""
    if p.spool:
        spool = p.spool
    else:
        root = outdir.make_dir(os.path.join(out, SPOOL))
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if name.isdigit() and not locks.pid_alive(int(name)) and outdir.owned(path):
                clear_spool(path)
                outdir.remove(path)
        spool = outdir.make_dir(os.path.join(root, str(os.getpid())))
    outdir.make_dir(os.path.join(out, "logs"))
    cache_dir = os.path.join(out, CACHE)
    files, used = prepare_cache(cache_dir, p.cache_bytes)
    if p.cache_bytes:
        log.info(f"sample cache {cache_dir}: {files} files, {used / 1e9:.2f} of {p.cache_bytes / 1e9:.2f} GB")
    return spool
