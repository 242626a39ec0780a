"""Stage 02's preflight: everything that can be checked before the verifier loads, in well under 3 s and
without importing torch or vLLM. It returns the plan `--dry-run` prints.

Memory model (an estimate, deliberately on the safe side):
  weights       = the checkpoint index's total_size, else the bytes of its *.safetensors / *.bin files (split over
                  --tp-size GPUs; an INT4 checkpoint counts what it really holds); on a CPU computing in float32,
                  a bf16 checkpoint counts twice
  per token     = KV cache (2 * layers * kv_heads * head_dim * b bytes; MLA: layers * (latent + rope) * b bytes)
                + captured states (2 * (L+1) * hidden * b bytes: this batch's, and the HF backend's previous batch
                  held on the GPU until its copy to host is queued); b = 2 in bf16, 4 in float32
                + working activations (~ (4 * hidden + 2 * intermediate) * 4 bytes, one layer at a time; for a
                  mixture of experts, intermediate = the top-k routed plus shared experts' widths if larger)
  worst batch   = --batch-size * --max-seq-len tokens (or --max-tokens-per-batch when given)
  available     = GPU: memory per GPU * --gpu-memory-utilization * tp - weights; CPU: MemAvailable - weights
"""
import dataclasses
import os
from typing import Optional

from ..base import compute, devices
from ..base.devices import available_ram, visible_gpus
from ..base.errors import UsageError, quote
from ..engines import engines
from ..engines.engine import cpu_kv_cache_bytes
from ..formats.hidden_states import bytes_per_token
from ..storage import files, outdir
from ..storage.files import load_stage
from ..storage.input_watch import file_digest
from ..verifier import quantization, verifier
from ..verifier.verifier import weights_bytes, TOKENIZER_FILES


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the preflight found and decided; `--dry-run` prints it."""
    jsonl: str                  # stage 01's tokenized_data.jsonl
    prepared_manifest: dict
    verifier: dict              # the fingerprint (verifier.fingerprint)
    layer_ids: list             # the auxiliary ids, then n
    hidden_size: int
    rows: int
    tokens: int
    batches_at_most: int
    disk_bytes: int
    disk_per_token: int
    disk_free_bytes: int
    weights_bytes: Optional[int]
    bytes_per_token: int        # memory per token (KV cache, captured states, activations)
    worst_batch_tokens: int
    memory_available_bytes: int
    gpus: int
    device: str
    compute: compute.Compute    # the dtype the verifier computes in, and why
    warning: Optional[str]
    quantization: Optional[str] = None  # what a quantized verifier is, its size per GPU, the kernel that runs it

    @property
    def n_states(self):
        return len(self.layer_ids)

    @property
    def on_gpu(self):
        return self.gpus > 0


def per_token_bytes(cfg, n_states, value_bytes=2):
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    heads = cfg.get("num_attention_heads") or 1
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V3 / Kimi): one compressed latent per layer
        kv = layers * (cfg["kv_lora_rank"] + cfg.get("qk_rope_head_dim", 64)) * value_bytes
    else:
        kv = 2 * layers * kv_heads * head_dim * value_bytes
    inter = cfg.get("intermediate_size") or 4 * hidden
    # MoE (DeepSeek-V3, Kimi): each token's top-k routed experts, plus the shared ones, are live at once
    experts = (cfg.get("num_experts_per_tok") or 0) + (cfg.get("n_shared_experts") or 0)
    inter = max(inter, experts * (cfg.get("moe_intermediate_size") or 0))
    act = (4 * hidden + 2 * inter) * 4
    return kv + 2 * n_states * hidden * value_bytes + act


def check_memory(args, cfg, n_states, weights, gpus, rows, longest, note="", value_bytes=2):
    """(available bytes, bytes per token, worst-case tokens); refuses a batch that cannot fit. `weights`: as loaded
    (a bf16 checkpoint computed in float32 on a CPU takes twice its size)."""
    per_tok = per_token_bytes(cfg, n_states, value_bytes)
    worst = min(min(args.batch_size, rows) * longest, args.tokens_per_batch)
    if gpus:
        per_gpu = min(t for _, t in gpus[: max(args.tp_size, 1)])
        n = args.tp_size if engines.kind(args.backend).weights_split_evenly else len(gpus)
        avail = int(per_gpu * args.gpu_memory_utilization * n) - (weights or 0)
        where = f"{n} GPU(s) x {per_gpu / 2**30:.0f} GiB x {args.gpu_memory_utilization}"
    else:
        avail = available_ram() - (weights or 0)
        if engines.kind(args.backend).cpu_kv_cache_reserved:  # vLLM-CPU reserves it whole, as make_llm sizes it
            avail -= cpu_kv_cache_bytes(cfg, args.max_seq_len + 1, args.batch_size, spec_tokens=1)
        where = "available RAM"
    if avail <= 0:
        raise UsageError(f"--model-path {args.model_path}: weights ({(weights or 0) / 2**30:.1f} GiB) do not fit in "
                         f"{where}; use more GPUs (--tp-size) or a smaller model")
    if worst * per_tok > avail:
        fit = avail // (per_tok * longest)
        hint = f"the largest --batch-size that fits is {fit}" if fit >= 1 else \
            f"not even one {longest}-token sample fits; lower --max-seq-len"
        raise UsageError(f"--batch-size {args.batch_size}: a worst-case batch of {worst:,} tokens needs about "
                         f"{worst * per_tok / 2**30:.1f} GiB but {avail / 2**30:.1f} GiB is left after the weights "
                         f"({where}); {hint}{note}")
    return avail, per_tok, worst


def resolve_prepared(flag, path):
    """(jsonl path, stage 01 manifest) from the stage 01 folder or its tokenized_data.jsonl."""
    folder, jsonl = (path, os.path.join(path, "tokenized_data.jsonl")) if not path.endswith(".jsonl") \
        else (os.path.dirname(path) or ".", path)
    if os.path.basename(jsonl) != "tokenized_data.jsonl":
        raise UsageError(f"{flag} {path}: stage 02 reads the tokenized_data.jsonl of a stage 01 folder; give that "
                         f"folder (a file of rows of your own needs a manifest: run 01_prepare_dataset.py)")
    manifest = load_stage(flag, folder, "prepare")
    if not os.path.isfile(jsonl):
        raise UsageError(f"{flag} {path}: {jsonl} not found; rerun 01_prepare_dataset.py")
    readable(flag, [jsonl])
    return jsonl, manifest


def check_unchanged(flag, jsonl, manifest):
    """Stage 01's rows as its manifest describes them: a hash of the file (a few seconds a GB), so that an edit is
    found before the model loads, not by the watch after every row is extracted."""
    now = file_digest(jsonl)
    if now != manifest["content_id"]:
        raise UsageError(f"{flag} {os.path.dirname(jsonl) or '.'}: tokenized_data.jsonl changed since stage 01 wrote it "
                         f"(content id {now}, its manifest says {manifest['content_id']}); rerun 01_prepare_dataset.py")


def readable(flag, paths):
    """Every file the run opens, openable for reading now: an unreadable one (mode 000, another user's) would stop
    the run seconds after a preflight that only looked at names."""
    for p in paths:
        try:
            os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError as e:
            raise UsageError(f"{flag}: cannot read {quote(p)} ({e.strerror}); the run opens it: fix its permissions")


def model_inputs(model_path, trust_remote_code):
    """The files of a local verifier folder that the run opens: config, tokenizer, weights and their index, and with
    --trust-remote-code its code. (generation_config.json is optional to the loaders, which skip it when unreadable.)"""
    if not os.path.isdir(model_path):
        return []  # a hub id: the cache's files, read by the fingerprint
    names = sorted(os.listdir(model_path))
    keep = [n for n in names if n == "config.json" or n in TOKENIZER_FILES or n.endswith(
        (".safetensors", ".bin", ".pt", ".gguf", ".index.json")) or (trust_remote_code and n.endswith(".py"))]
    return [os.path.join(model_path, n) for n in keep if os.path.isfile(os.path.join(model_path, n))]


def plan(args):
    """Every check that needs no model load (`args`: settings.Extract) -> the Plan --dry-run prints."""
    jsonl, prep = resolve_prepared("--prepared-data", args.prepared_data)
    readable("--model-path", model_inputs(args.model_path, args.trust_remote_code))
    fp, tc = verifier.open_verifier(args.model_path, args.trust_remote_code)
    verifier.check_weights(args.model_path)
    diff = verifier.same_verifier(fp, prep["verifier"])
    if diff:
        raise UsageError(f"--prepared-data {args.prepared_data}: prepared for another verifier ({diff}: "
                         f"{prep['verifier'].get(diff)} vs {fp.get(diff)} for --model-path); rerun "
                         f"01_prepare_dataset.py with --model-path {args.model_path}")
    counts = prep["counts"]
    if counts["max_token_id"] >= fp["vocab_size"]:
        raise UsageError(f"--prepared-data: token id {counts['max_token_id']} >= vocab size {fp['vocab_size']}")
    if counts["max_row_tokens"] > args.max_seq_len:
        raise UsageError(f"--max-seq-len {args.max_seq_len}: the prepared rows reach {counts['max_row_tokens']} "
                         f"tokens; raise --max-seq-len or rerun 01_prepare_dataset.py with --max-seq-len "
                         f"{args.max_seq_len}")
    maxpos = fp.get("max_position_embeddings")
    if maxpos and args.max_seq_len + 1 > maxpos:
        raise UsageError(f"--max-seq-len {args.max_seq_len}: the verifier handles {maxpos} positions")
    n = fp["num_hidden_layers"]
    layer_ids = verifier.resolve_layer_ids(args.layer_ids, n)
    gpus = visible_gpus()
    dtype = compute.resolve(args.dtype, bool(gpus))
    kind = engines.kind(args.backend)
    quant = quantization.read(args.model_path)
    engines.check_engine(kind, args.tp_size, f"--tp-size {args.tp_size}", fp, gpus, dtype.dtype,
                         "stage 02's files are bf16", quant, fp.get("architecture"))
    if kind.tensor_parallel:
        if gpus and args.tp_size > len(gpus):
            raise UsageError(f"--tp-size {args.tp_size}: only {len(gpus)} GPU(s) visible "
                             f"({devices.visible_words()})")
        if not gpus and args.tp_size > 1:
            raise UsageError(f"--tp-size {args.tp_size}: no GPU visible; on CPU use --tp-size 1")
    rows = counts["rows"]
    if not kind.tensor_parallel and args.tp_size > 1:
        raise UsageError(f"--tp-size {args.tp_size}: the hf backend has no tensor parallelism (it places whole layers "
                         f"on the visible GPUs, one GPU at a time); use --backend vllm, or drop --tp-size and choose "
                         f"the GPUs with CUDA_VISIBLE_DEVICES")
    if args.batch_size > rows:
        log_warn = (f"--batch-size {args.batch_size} is larger than the {rows} prepared samples: it is the number "
                    f"of samples per forward step, not the number of samples to extract (all are extracted)")
    else:
        log_warn = None
    outdir.check("--output-dir", args.output_dir, "extract", [("--model-path", args.model_path), ("--prepared-data", args.prepared_data)], args.shard)
    n_states = len(layer_ids)
    disk_per_token = bytes_per_token(n_states, fp["hidden_size"], args.storage_dtype)
    disk_need = counts["tokens"] * disk_per_token
    # a resumed run needs only what its existing files do not already hold
    have = sum(e.stat().st_size for e in os.scandir(args.output_dir) if e.name.startswith("hs_")) \
        if os.path.isdir(args.output_dir) else 0
    free = files.free_bytes(args.output_dir)
    if disk_need - have > free:
        raise UsageError(f"--output-dir {args.output_dir}: needs about {(disk_need - have) / 1e9:.2f} GB more, "
                         f"{free / 1e9:.2f} GB free")
    stored = quant.dequantized_bytes if quant and not kind.keeps_quantized else weights_bytes(args.model_path)
    weights = compute.loaded_weights_bytes(stored, fp.get("torch_dtype"), dtype.dtype)
    note = f" ({log_warn.split(': ', 1)[1]})" if log_warn and args.batch_size > rows else ""
    avail, per_tok, worst = check_memory(args, tc, n_states, weights, gpus, rows, counts["max_row_tokens"], note,
                                         compute.value_bytes(dtype.dtype))
    batches = -(-rows // args.batch_size)
    return Plan(jsonl=jsonl, prepared_manifest=prep, verifier=fp, layer_ids=layer_ids, hidden_size=fp["hidden_size"],
                rows=rows, tokens=counts["tokens"], batches_at_most=batches, disk_bytes=disk_need,
                disk_per_token=disk_per_token, disk_free_bytes=free, weights_bytes=weights, bytes_per_token=per_tok,
                worst_batch_tokens=worst, memory_available_bytes=avail, gpus=len(gpus),
                device=f"{len(gpus)} GPU(s): {gpus[0][0]}" if gpus else "CPU", compute=dtype, warning=log_warn,
                quantization=quant_line(quant, kind, args.tp_size, bool(gpus)))


def quant_line(q, kind, tp, on_gpu):
    """The plan's line for a quantized verifier: what, the weights' real size per GPU, and what runs it here."""
    if q is None:
        return None
    if not kind.keeps_quantized:
        return (f"{q.describe()}; {q.stored_bytes / 1e9:.2f} GB as stored, decompressed by transformers to "
                f"{q.dequantized_bytes / 1e9:.2f} GB in bf16")
    _, runs = quantization.kernel_here(q, on_gpu)
    return (f"{q.describe()}; {q.stored_bytes / 1e9:.2f} GB as stored, {q.stored_bytes / max(tp, 1) / 2**30:.2f} GiB "
            f"per GPU at TP {tp}; here: {runs}")


def format_plan(p):
    gib = 2**30
    return "\n".join([
        f"plan: {p.rows:,} samples, {p.tokens:,} tokens, up to {p.batches_at_most:,} batches",
        f"  {p.compute.describe()}",
        f"  layer ids: {p.layer_ids} (auxiliary, then id {p.layer_ids[-1]} = last layer before the final norm)",
        *([f"  quantization: {p.quantization}"] if p.quantization else []),
        f"  disk: {p.disk_bytes / 1e9:.2f} GB to write ({p.disk_per_token:,} B/token), {p.disk_free_bytes / 1e9:.1f} GB free",
        f"  memory: weights {(p.weights_bytes or 0) / gib:.2f} GiB; worst batch {p.worst_batch_tokens:,} tokens x "
        f"~{p.bytes_per_token:,} B = {p.worst_batch_tokens * p.bytes_per_token / gib:.2f} GiB of "
        f"{p.memory_available_bytes / gib:.1f} GiB left ({p.device})",
    ])
