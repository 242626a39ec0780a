"""vLLM's ExampleHiddenStatesConnector for a CPU-only torch.

The stock connector copies states device-to-host asynchronously through `torch.cuda.Stream`/`Event` into
pinned memory, which raises on a CPU-only torch ("pin_memory=True requires a CUDA or other accelerator
backend"). Here the states already live in host memory: slice them out of the cache, copy them as bf16 (the cache
blocks are freed right after; a float32 engine's states are rounded, so files are bf16 either way), and hand the
write to the connector's own thread pool, which writes our format. Loaded by vLLM through
`kv_connector_module_path = "eagle3pipe.engines.cpu_connector"`. Everything else is the stock connector.
"""
import fcntl
import os
from functools import partial

import torch

from eagle3pipe.formats.hidden_states import finite, save

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)


class _Done:
    """Stands in for the CUDA event the base class polls in get_finished: the copy is already complete."""

    def query(self):
        return True

    def synchronize(self):
        pass


def _write_checked(tensors, filename, lock_fd):
    """The connector's write thread, in the engine's process where the states already are: our file format (CRC-32
    in the header) plus whether every value is finite, so stage 02's own process validates the file from its
    header and token ids and renames it, without reading the states again."""
    try:
        save(filename, tensors, finite=int(finite(tensors["hidden_states"])))
    finally:
        if lock_fd is not None:
            os.close(lock_fd)  # releases the lock stage 02 waits on


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending):
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        n = pending.token_ids.shape[0]
        # [T, L+1, H]: one "head" per captured layer id, copied out before the blocks are reused; stored bf16 whatever
        # the engine computes in (float32 on a CPU without native bf16: rounded here, the format stays the same)
        states = extract_from_kv_cache(self._kv_cache, slots, n)
        states = states.clone() if states.dtype == torch.bfloat16 else states.to(torch.bfloat16)
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(_write_checked, tensors, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
