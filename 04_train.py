"""Stage 04: train the EAGLE-3 draft with speculators into a checkpoint vLLM serves as an `eagle3` speculator.

Usage:
    python 04_train.py --config configs/smollm2-135m.yaml --epochs 3
    python 04_train.py --model-path M --prepared-data data/prepared --hidden-states data/hidden_states \
        --vocab-mapping data/vocab_map_32000 --output-dir data/checkpoints --epochs 10
    torchrun --nproc-per-node 8 04_train.py --config configs/kimi-k2.5-int4.yaml [--fsdp]
    python 04_train.py --config configs/smollm2-135m.yaml --online [--backend hf] [--cache-gb 20]

Inputs:  stages 01 (rows, loss masks), 02 (hidden states, layer ids), 03 (d2t/t2d); all three manifests and the
         files are checked against each other and the verifier before anything heavy is imported. With --online no
         stage 02: an extraction engine (vLLM's server or eagle3pipe/engines/hf_server.py) generates each batch's states
         ahead of the trainer; they are deleted once read, or kept up to --cache-gb (eagle3pipe/train/online.py).
Outputs: --output-dir/<epoch>/ speculators checkpoints (config.json + model.safetensors), `last` and
         `checkpoint_best` pointers, manifest.json, train.log-style dense lines on stderr. A rerun of the same
         command resumes from the last checkpoint (mid-epoch ones with --checkpoint-freq < 1).
On a machine without an accelerator a small compatibility layer (eagle3pipe/adapters.py) makes speculators'
Trainer run on CPU (eager loss, sdpa attention).
"""
import argparse
import os

from eagle3pipe.base import errors
from eagle3pipe.config import cli
from eagle3pipe.drafts import archs
from eagle3pipe.engines import engines
from eagle3pipe.train import checkpoints, train_plan, validation_measure


def parse_args(argv=None):
    p = cli.Parser(description="Stage 04: train the EAGLE-3 draft with speculators.")
    p.add_argument("--model-path", help="verifier: HF model folder or hub id")
    p.add_argument("--prepared-data", default="data/prepared", help="stage 01 folder")
    p.add_argument("--hidden-states", default="data/hidden_states", help="stage 02 folder")
    p.add_argument("--vocab-mapping", default="data/vocab_map_32000", help="stage 03 folder")
    p.add_argument("--output-dir", default="data/checkpoints", help="checkpoint folder")
    p.add_argument("--epochs", type=int, default=3,
                   help="passes over the rows; the best epoch falls as data grows (docs/RECIPE.md: 8 at 1,000 rows, "
                        "3 or more at 16,000), so fewer rows want more")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="peak learning rate (Muon on 2-D weights, AdamW on the rest; docs/RECIPE.md)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warmup steps (default: speculators')")
    p.add_argument("--total-seq-len", type=int, default=8192, help="tokens per packed training batch")
    p.add_argument("--num-layers", type=int, default=1, help="draft decoder layers")
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps (= speculative tokens)")
    r = p.add_argument_group("the draft's recipe (speculators' own options; docs/STAGES.md, stage 04)")
    r.add_argument("--draft-arch", choices=["auto", *archs.ARCHS], default="auto",
                   help="the draft's decoder layer: auto = the verifier's family (deepseek for MLA verifiers such as "
                        "DeepSeek-V3/Kimi, qwen3 for Qwen3), else llama; deepseek: MLA attention like the verifier's")
    r.add_argument("--norm-before-fc", action=argparse.BooleanOptionalAction, default=None,
                   help="one RMSNorm over the concatenated auxiliary states before the FC projection (default: on, "
                        "unless --fc-norm, which replaces it)")
    r.add_argument("--fc-norm", action=argparse.BooleanOptionalAction, default=False,
                   help="an RMSNorm per auxiliary state before the FC projection (EAGLE-3.1)")
    r.add_argument("--norm-output", action=argparse.BooleanOptionalAction, default=True,
                   help="feed post-norm hidden states back across TTT steps (EAGLE-3.1)")
    r.add_argument("--loss-fn", default="kl_div",
                   help="kl_div, rkl, jsd, ce, tv, nla, lk_hybrid, or a JSON object of them with weights")
    r.add_argument("--ttt-step-loss-decay", type=float, default=1.0,
                   help="each TTT step's loss weighs this times the step before (1.0: all equal)")
    r.add_argument("--optimizer", choices=["adamw", "muon"], default="muon",
                   help="muon (speculators' default: Muon on 2-D weights, AdamW on the rest) or adamw")
    r.add_argument("--scheduler", choices=["linear", "cosine", "none"], default="linear",
                   help="the learning-rate schedule after warmup")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--checkpoint-freq", type=float, default=1.0,
                   help=">= 1: every N epochs; < 1: that fraction of an epoch (mid-epoch resume)")
    p.add_argument("--log-every", type=int, default=10, help="a dense progress line every N steps")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile N training steps after the first 5 (torch.profiler: time per operator, CPU and GPU) "
                        "into logs/profile.txt and logs/profile_trace.json; 0: none")
    p.add_argument("--val-ratio", type=float, default=0.05, help="rows held out for validation")
    p.add_argument("--num-samples", type=int, default=None,
                   help="train on the first N rows of stage 01's output (a random subset of its records: stage 01 "
                        "shuffles them by its --seed), validation included; the rest of stage 02's states stay "
                        "unread (default: all)")
    p.add_argument("--measure-prompts", type=int, default=32,
                   help="checkpoint_best by the acceptance length vLLM would measure on the first turns of this many "
                        "validation rows (the verifier's greedy answers, made once; needs the verifier's weights <= "
                        "10 GB); 0: by the trainer's estimate")
    p.add_argument("--measure-tokens", type=int, default=64, help="answer tokens per prompt for --measure-prompts")
    p.add_argument("--num-workers", type=int, default=None, help="dataloader workers (default: 0 on CPU; on GPU up to 12 per rank, cores allowing)")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP under torchrun (default: DDP)")
    cli.add_dtype_flag(p, "the draft (and an --online engine)")
    p.add_argument("--loss-implementation", choices=["auto", "fused", "eager"], default="auto",
                   help="speculators' loss: auto = its Triton-fused loss where a seconds-long probe compiles it, else eager "
                        "(always on CPU)")
    p.add_argument("--verify-data", action="store_true",
                   help="check every hidden-state file's CRC before step 1 (default: each sample as it is read; at "
                        "Kimi's scale a full pass takes hours)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--overwrite", action="store_true", help="delete previous checkpoints in --output-dir first")
    o = p.add_argument_group("online training (no stage 02 folder; see docs/ONLINE.md)")
    o.add_argument("--online", action="store_true", help="generate hidden states on demand with an extraction engine")
    o.add_argument("--backend", choices=list(engines.KINDS), default="vllm", help="the engine: vLLM's server or transformers")
    o.add_argument("--layer-ids", type=cli.int_list, default=None,
                   help="auxiliary layer ids as stage 02 takes them (none: [2, n//2, n-3]); id n is always added")
    o.add_argument("--cache-gb", type=float, default=0.0, help="keep generated samples up to N GB for later epochs")
    o.add_argument("--engine-address", default=None, help="host:port of an engine already running (not started here)")
    o.add_argument("--engine-spool", default=None,
                   help="with --engine-address: the folder that engine writes to (its --spool, on a filesystem both "
                        "share); its files are read and deleted only there")
    o.add_argument("--engine-gpus", type=cli.int_list, default=None,
                   help="GPUs for the engine, tensor parallel over them (none: one GPU is shared, else the first half)")
    o.add_argument("--engine-port", type=int, default=None, help="port for the engine (none: a free one)")
    o.add_argument("--engine-memory", type=float, default=None,
                   help="fraction of each engine GPU vLLM may use (none: 0.85, or 0.45 on a GPU shared with training)")
    o.add_argument("--engine-timeout", type=int, default=3600, help="seconds the engine may take to load")
    return cli.parse_args(p, "train", argv, required=["model_path"])


def main():
    args = parse_args()
    log = cli.setup_logging()
    rank = int(os.environ.get("RANK", "0"))
    plan = train_plan.plan(args, rank)  # every check, in seconds, before anything loads
    errors.MEMORY = train_plan.memory_hint(args, plan.rows, plan.device.on_gpu, plan.states is not None)
    out, previous = checkpoints.prepare_output(args, plan.identity, plan.inputs, rank,  # rank 0 holds the folder's
                                               carry=lambda old: train_plan.horizon(args))  # lock from here on
    from eagle3pipe.train import online, train_data, training
    on_cpu, dtype = train_plan.confirm_device(args, plan, rank)
    if rank == 0:
        training.write_draft_layer(out, plan.recipe, plan.text_cfg, args.num_layers)
    bridge = os.path.join(out, ".bridge")  # stage 01's rows as speculators' Arrow table
    data = online.Session(args, plan.states, out, rank, plan.rows, bridge) if plan.states else \
        train_data.OfflineData(args, plan.ext, out, rank, plan.rows, bridge, dtype.dtype)
    with data:  # online: the engine runs (and is watched) until training ends
        cfg = training.train_config(args, bridge, plan.aux, on_cpu, plan.draft_vocab, engine_url=data.url,
                                    storage=plan.ext.storage_dtype, dtype=dtype.dtype,
                                    recipe_=plan.recipe)
        log.info(f"training a {args.num_layers}-layer EAGLE-3 draft on {len(plan.rows) - len(plan.failed)} rows "
                 f"({plan.rows.tokens:,} tokens), aux layer ids {plan.aux}, draft vocab "
                 f"{plan.draft_vocab:,}, {'CPU' if on_cpu else 'GPU'}, {dtype.dtype}")
        measure = validation_measure.plan(args, plan.rows, plan.aux, on_cpu) if rank == 0 else None
        result = training.run(cfg, args, on_cpu, dtype.dtype, data.loaders(), measure, data.batch_step,
                              plan.targets.norm if plan.targets else None)
    result.update(data.summary())
    return checkpoints.finish(args, plan, out, previous, result, cfg, on_cpu, dtype, rank)


if __name__ == "__main__":
    cli.run(main, exit_now=True)
