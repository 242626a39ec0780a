"""The two ways the pipeline runs the verifier for its hidden states, as objects: the facts the preflights, the
writer and the online plan ask of each, and the server an --online run starts (the runtime classes are in
backends.py). The choice by name happens here alone (`kind`); a new backend is one class here, its runtime class,
and one line in KINDS."""


class VLLM:
    name = "vllm"
    module = "vllm"                  # what must be installed
    tensor_parallel = True           # --tp-size / the engine's GPUs split every layer: TP must divide the heads
    weights_split_evenly = True      # each GPU holds 1/TP of the weights
    cpu_kv_cache_reserved = True     # vLLM-CPU reserves its KV cache up front (VLLM_CPU_KVCACHE_SPACE)
    connector = True                 # states leave through vLLM's hidden-states connector (our CPU one on a CPU)
    background_writer_on_cpu = True  # the connector's files are rewritten in the background, next to the engine
    keeps_quantized = True           # quantized weights stay packed and run on vLLM's kernels for them
    server = None                    # --online: vLLM's own OpenAI-compatible server (engine.server_module)


class HF:
    name = "hf"
    module = "transformers"
    tensor_parallel = False          # whole layers placed on the visible GPUs, one GPU at a time
    weights_split_evenly = False     # the GPUs fill one after another
    cpu_kv_cache_reserved = False
    connector = False
    background_writer_on_cpu = False
    keeps_quantized = False          # transformers decompresses compressed-tensors int4 experts to bf16 as it loads
    server = "eagle3pipe.hf_server"  # --online: the same two API calls, answered with transformers


KINDS = {k.name: k for k in (VLLM, HF)}


def kind(name):
    """The backend called `name` (settings restrict it to KINDS' names)."""
    return KINDS[name]
