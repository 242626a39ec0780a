"""Stage 02's two ways of running the verifier.

- HFBackend.forward([(row, ids)]) -> {row: hidden_states.Pending}: one padded batch; its host copy is queued by the
  next forward() (or flush(), which the caller owes after its last batch) and lands behind that batch's compute.
  `recover()` after an out-of-memory error (the run loop splits the batch).
- VLLMBackend.forward([(row, ids)]) -> {row: path of the file the engine is writing}; the engine's KV cache is
  allocated up front, so there is no per-batch out-of-memory to recover from.

Layer ids (see verifier.py): id k < n is the INPUT of decoder layer k, id n the OUTPUT of the last decoder
layer before the final norm.
"""
import logging
import os
import threading
from ..formats.hidden_states import Pending, SCALES, quantize_fp8
from ..verifier.verifier_weights import check_loaded
from .engine import connector_config, generate, make_llm

log = logging.getLogger("eagle3")


class HFBackend:
    """transformers with forward hooks on only the needed decoder layers: no output_hidden_states (which would
    keep every layer's activations) and no lm_head (AutoModel loads the bare decoder stack)."""

    def __init__(self, model_path, layer_ids, trust_remote_code=False, device=None, storage="bf16", dtype="bfloat16"):
        """`dtype`: what the model computes in (compute.py); the states are stored bf16 (or fp8) either way."""
        import torch
        import transformers
        from transformers import AutoModel
        transformers.utils.logging.disable_progress_bar()  # a bar per load: noise in a nohup log
        self.torch = torch
        cuda = torch.cuda.is_available()
        self.device = device or ("cuda" if cuda else "cpu")
        # several GPUs: layers spread over them; one: loaded straight onto it (not through host memory)
        spread = self.device == "cuda" and torch.cuda.device_count() > 1
        self.model, info = AutoModel.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                     trust_remote_code=trust_remote_code, output_loading_info=True,
                                                     device_map="auto" if spread else {"": self.device})
        check_loaded(info, model_path)  # a weight transformers filled at random: the stage stops (verify() ran first)
        self.model.eval()
        layers = self._decoder_layers(self.model)
        n = len(layers)
        self.layer_ids, self.captured = layer_ids, {}
        for slot, k in enumerate(layer_ids):
            if k < n:  # input of layer k
                layers[k].register_forward_pre_hook(self._pre_hook(slot), with_kwargs=True)
            else:      # id n: output of the last layer, before the final norm
                layers[n - 1].register_forward_hook(self._post_hook(slot))
        self.input_device = next(self.model.parameters()).device
        self.storage, self.pin_bytes = storage, 0
        self.nan_rows = {int(x) for x in os.environ.get("EAGLE3_INJECT_NAN_ROWS", "").split(",") if x.strip()}
        self.copy_stream = torch.cuda.Stream(self.input_device) if self.input_device.type == "cuda" else None
        self.held = None  # the last batch's states, until its device-to-host copy is queued (see _hold)

    @staticmethod
    def _decoder_layers(model):
        for path in ("layers", "model.layers", "language_model.layers", "language_model.model.layers",
                     "decoder.layers", "h"):
            obj = model
            for part in path.split("."):
                obj = getattr(obj, part, None)
            if obj is not None and hasattr(obj, "__len__"):
                return obj
        raise RuntimeError(f"cannot find the decoder layers of {type(model).__name__}")

    def _pre_hook(self, slot):
        def hook(module, args, kwargs):
            self.captured[slot] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return hook

    def _post_hook(self, slot):
        def hook(module, args, output):
            self.captured[slot] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    def forward(self, batch):
        """-> {row: Pending}. Nothing here waits for the GPU: the states are stacked, checked for non-finite values
        (and quantized for fp8) on the device, copied into a pinned host buffer on a side stream once the next
        batch's model call has returned (or at flush()), and the writer threads wait for that copy, so the next
        batch's forward runs while this one's files are written. The buffer is requested at one size (the largest
        batch's, which comes first), so the pinned-memory cache hands back a freed one instead of pinning new memory
        for every batch."""
        torch = self.torch
        t_max = max(len(ids) for _, ids in batch)
        ids = torch.zeros(len(batch), t_max, dtype=torch.long)
        mask = torch.zeros(len(batch), t_max, dtype=torch.bool)
        for b, (_, row) in enumerate(batch):  # right padding: real tokens keep positions 0..T-1
            ids[b, : len(row)] = torch.as_tensor(row)
            mask[b, : len(row)] = True
        self.captured.clear()
        with torch.inference_mode():
            mask = mask.to(self.input_device, non_blocking=True)
            try:
                self.model(input_ids=ids.to(self.input_device, non_blocking=True), attention_mask=mask.long(),
                           use_cache=False)
            finally:  # past the model's own host syncs: the previous batch's copy can no longer delay them
                self.flush()
            # [B, S, L+1, H]: one slot per layer id, in order (the last is id n)
            states = torch.stack([self.captured[s].to(self.input_device) for s in range(len(self.layer_ids))], dim=2)
            self.captured.clear()
            for b, (i, _) in enumerate(batch):
                if i in self.nan_rows:  # fault injection: poison the states the real check below sees
                    states[b, 0, 0, 0] = float("nan")
            # [B]: any non-finite value among a row's real tokens (padding excluded)
            bad = ((~torch.isfinite(states).flatten(2).all(-1)) & mask).any(1)
            out = {"hidden_states": states.to(torch.bfloat16), "bad": bad}  # float32 compute: rounded to bf16 here
            if self.storage == "fp8":  # [B, S, L+1, H] fp8 + [B, S, 1, 1] fp32 scales: half the copy and the disk
                q, scale = quantize_fp8(states.flatten(0, 1))
                out.update({"hidden_states": q.unflatten(0, states.shape[:2]), SCALES: scale.unflatten(0, states.shape[:2])})
            copy = None
            if states.is_cuda:
                out, copy = self._hold(out)
        bad = out.pop("bad")
        return {i: Pending({k: v[b, : len(row)] for k, v in out.items()}, copy, bad[b])
                for b, (i, row) in enumerate(batch)}

    def _hold(self, out):
        """Host views of `out` in a pinned buffer, filled by a copy queued at the next forward() or flush(). Queued
        now, the copy would hold the copy engine while the next batch's model makes its host syncs (transformers'
        mask checks read a scalar back): the GPU idled ~13 ms a batch at Kimi's width (0.91x of a bare forward)."""
        torch = self.torch
        sizes = {k: -(-v.numel() * v.element_size() // 64) * 64 for k, v in out.items()}
        self.pin_bytes = max(self.pin_bytes, sum(sizes.values()))
        buf = torch.empty(self.pin_bytes, dtype=torch.uint8, pin_memory=True)
        host, offset = {}, 0
        for k, v in out.items():
            host[k] = buf[offset: offset + v.numel() * v.element_size()].view(v.dtype).view(v.shape)
            offset += sizes[k]
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.input_device))  # this batch's states are complete
        copy = DeferredCopy()
        self.held = (out, host, ready, copy)
        return dict(host), copy  # the caller pops "bad" from its own dict

    def flush(self):
        """Queue the held batch's device-to-host copy. Writers waiting on it are released even if this fails."""
        held, self.held = self.held, None
        if held is None:
            return
        torch = self.torch
        out, host, ready, copy = held
        try:
            self.copy_stream.wait_event(ready)
            # inference mode: the host views were made in forward()'s, and a caller may flush outside it
            with torch.inference_mode(), torch.cuda.stream(self.copy_stream):
                for k, v in out.items():
                    v.record_stream(self.copy_stream)  # keep the device memory until the copy is done
                    host[k].copy_(v, non_blocking=True)
                # blocking: a writer thread waiting on it sleeps instead of spinning in the driver (4-8 spinning
                # writers slowed the main thread's kernel launches by ~10% at Kimi's width, issue 15)
                copy.event = torch.cuda.Event(blocking=True)
                copy.event.record(self.copy_stream)
        finally:
            copy.queued.set()

    def recover(self):
        self.flush()
        self.captured.clear()
        if self.torch.cuda.is_available():
            self.torch.cuda.empty_cache()


class VLLMBackend:
    """The offline vllm.LLM API with the `extract_hidden_states` method and the hidden-states KV connector: a
    prompt's states are written to `staging` by the engine; the run loop validates and renames them."""

    def __init__(self, s, layer_ids, staging, on_gpu, dtype, log_path):
        """`s`: stage 02's settings (settings.Extract); `dtype`: the compute dtype (the connector stores bf16);
        `log_path`: where the engine's own output goes (engine.make_llm)."""
        if not on_gpu:
            import torch
            torch.set_num_threads(1)  # this process only validates and writes files: leave the cores to the engine
        self.staging = staging  # the spool this stage made: the only place the engine's answers are used
        self.llm = make_llm(
            s.model_path, tp=s.tp_size, on_gpu=on_gpu, trust_remote_code=s.trust_remote_code, dtype=dtype,
            log_path=log_path,
            max_model_len=s.max_seq_len + 1,  # the prompt plus the one generated token
            max_num_seqs=s.batch_size, max_num_batched_tokens=max(s.tokens_per_batch, s.max_seq_len + 1),
            gpu_memory_utilization=s.gpu_memory_utilization, enable_prefix_caching=False,
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}},
            kv_transfer_config=connector_config(staging, on_gpu))
        from vllm import SamplingParams  # after make_llm: importing vLLM prints, and the engine's log takes it
        self.params = SamplingParams(max_tokens=1, temperature=0.0)

    def forward(self, batch):
        """-> {row: path of the file the connector is writing}; the writer waits for its lock. One call per
        batch of similar lengths (longest first): on vLLM-CPU that prefills faster than one call for all rows with
        continuous batching (2,303 vs 2,161 tok/s on 284 ShareGPT rows, bench/bench_extract_cpu.py)."""
        import numpy as np

        # Python ints: the engine's request encoder takes no numpy scalars (the rows are int32 views, rows.py)
        prompts = [{"prompt_token_ids": np.asarray(ids).tolist()} for _, ids in batch]
        outs = generate(self.llm, prompts, self.params, use_tqdm=False)
        result = {}
        for (i, _), o in zip(batch, outs):
            path = (o.kv_transfer_params or {}).get("hidden_states_path")
            if not path:
                raise RuntimeError(f"row {i}: vLLM returned no hidden_states_path")
            result[i] = path
        return result

    def recover(self):
        pass

    def flush(self):
        pass


class DeferredCopy:
    """A device-to-host copy queued by a later call (HFBackend.flush): synchronize() waits until it is queued, then
    until it is complete. Raises if queuing it failed."""
    __slots__ = ("queued", "event")

    def __init__(self):
        self.queued, self.event = threading.Event(), None

    def synchronize(self):
        self.queued.wait()
        if self.event is None:
            raise RuntimeError("the device-to-host copy of this batch was never queued (an error in the run)")
        self.event.synchronize()
