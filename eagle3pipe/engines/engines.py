"""The two ways the pipeline runs the verifier for its hidden states, as objects: the facts the preflights, the
writer and the online plan ask of each, the runtime stage 02 starts (`start`: the classes are in backends.py), the
server an --online run starts, and the rules an engine is held to before anything loads (check_engine). The choice
by name happens here alone (`kind`); a new backend is its runtime's module and one record here, in KINDS."""
from ..adapters import check_private
from ..base.errors import UsageError
from ..verifier import quantization
from ..verifier.vllm_support import eagle3_refusal
from .backends import HFBackend, VLLMBackend


class VLLM:
    name = "vllm"
    module = "vllm"                  # what must be installed
    tensor_parallel = True           # --tp-size / the engine's GPUs split every layer: TP must divide the heads
    weights_split_evenly = True      # each GPU holds 1/TP of the weights
    cpu_kv_cache_reserved = True     # vLLM-CPU reserves its KV cache up front (VLLM_CPU_KVCACHE_SPACE)
    connector = True                 # states leave through vLLM's hidden-states connector (our CPU one on a CPU)
    background_writer_on_cpu = True  # the connector's files are rewritten in the background, next to the engine
    keeps_quantized = True           # quantized weights stay packed and run on vLLM's kernels for them
    memory_fraction = True           # --gpu-memory-utilization is its setting
    spool = True                     # it writes the states into a folder stage 02 makes (<out>/.incoming/<pid>)
    server = None                    # --online: vLLM's own OpenAI-compatible server (engine.server_module)

    @staticmethod
    def start(args, layer_ids, spool, on_gpu, dtype, log_path):
        """Stage 02's runtime (`args`: settings.Extract)."""
        return VLLMBackend(args, layer_ids, spool, on_gpu=on_gpu, dtype=dtype, log_path=log_path)


class HF:
    name = "hf"
    module = "transformers"
    tensor_parallel = False          # whole layers placed on the visible GPUs, one GPU at a time
    weights_split_evenly = False     # the GPUs fill one after another
    cpu_kv_cache_reserved = False
    connector = False
    background_writer_on_cpu = False
    keeps_quantized = False          # transformers decompresses compressed-tensors int4 experts to bf16 as it loads
    memory_fraction = False
    spool = False                    # its states come back in this process
    server = "eagle3pipe.engines.hf_server"  # --online: the same two API calls, answered with transformers

    @staticmethod
    def start(args, layer_ids, spool, on_gpu, dtype, log_path):
        return HFBackend(args.model_path, layer_ids, args.trust_remote_code, storage=args.storage_dtype, dtype=dtype)


KINDS = {k.name: k for k in (VLLM, HF)}


def kind(name):
    """The backend called `name` (settings restrict it to KINDS' names)."""
    return KINDS[name]


def check_engine(kind, tp, tp_words, text_cfg, gpus, dtype, reader, quant=None, architecture=None):
    """The extraction engine's rules, the same for stage 02 and stage 04 --online, before anything loads: our CPU
    connector adapts vLLM's (its private names must be in the installed vLLM), tensor parallel divides the heads
    (the KV heads may also be fewer than TP and divide it: vLLM replicates them), and vLLM on a GPU does not compute
    in float32 (its connector stores the states in the compute dtype; `reader` reads bf16). `tp_words`: how the
    operator chose TP, for the error line; `kind`: engines.kind(--backend). `quant` (quantization.read): a quantized
    verifier an engine that keeps it packed has no kernel for here is refused, naming why; so is an `architecture`
    (config.json's) the installed vLLM hands no auxiliary states out for (vllm_support.py)."""
    if quant and kind.keeps_quantized:
        ok, why = quantization.kernel_here(quant, bool(gpus))
        if not ok:
            raise UsageError(f"--backend {kind.name}: the verifier is {quant.describe()}, and {why}; use --backend "
                             f"hf (transformers decompresses them: {quant.dequantized_bytes / 2**30:.2f} GiB in bf16) "
                             f"or a GPU machine")
    why = None if kind.keeps_quantized else quantization.transformers_refusal(quant, bool(gpus), dtype)
    if why:
        raise UsageError(f"--backend {kind.name}, compute dtype {dtype}: {why}")
    if not kind.connector:
        return
    why = eagle3_refusal(architecture)
    if why:
        raise UsageError(f"--backend {kind.name}: {why}; use --backend hf (transformers)")
    if not gpus:
        check_private("vllm")
    for what in ("num_attention_heads", "num_key_value_heads"):
        h = text_cfg.get(what) if kind.tensor_parallel else None
        if h and h % tp and not (what == "num_key_value_heads" and tp % h == 0):
            raise UsageError(f"{tp_words}: must divide the verifier's {what} ({h})")
    if gpus and dtype == "float32":
        raise UsageError(f"--dtype float32: vLLM's hidden-states connector on GPU stores states in the compute dtype, "
                         f"and {reader}; use --dtype auto (bf16 on GPUs) or --backend hf")
