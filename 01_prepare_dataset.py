"""Stage 01: chat data -> the verifier's chat template -> token ids with assistant-only loss masks.

Usage:
    python 01_prepare_dataset.py --model-path data/models/smollm2-135m-instruct --dataset sharegpt \
        --num-samples 300 --output-dir data/prepared
    python 01_prepare_dataset.py --config configs/kimi-k2.5-int4.yaml

Inputs:  --model-path (HF folder or hub id: tokenizer + chat template); --dataset (`sharegpt` = the embedded
         ShareGPT, a .jsonl/.json/.parquet file or folder, or a hub dataset id). ShareGPT
         `conversations[{from, value}]` and OpenAI `messages[{role, content}]`, detected per record; OpenAI
         tool use (`tool_calls`, `tool` results, the record's `tools`) where the verifier's template renders it.
Outputs: --output-dir/tokenized_data.jsonl  one {"id", "input_ids", "loss_mask"} per line
         --output-dir/token_freq.npy        int64 [V] counts of loss-masked tokens per verifier token id
         --output-dir/manifest.json         arguments, verifier fingerprint, counts, versions, command
Selection: the first --num-samples records of the source (so records after them stay held out for
stage 05), written in an order shuffled by --seed. Every assistant turn is trained.
--regenerate: the verifier first rewrites every assistant turn (vLLM or transformers: eagle3pipe/prepare/regenerate.py),
         resumably;
         its answers also land in --output-dir/regenerated.jsonl.
The output folder must be new, empty or an earlier stage 01 output: only this stage's own files are replaced.
"""
from eagle3pipe.config import cli
from eagle3pipe.prepare import preparation, regenerate
from eagle3pipe.storage import outdir

def parse_args(argv=None):
    p = cli.Parser(description="Stage 01: tokenize chat data with assistant-only loss masks.")
    p.add_argument("--model-path", help="verifier: HF model folder or hub id (tokenizer + chat template)")
    p.add_argument("--dataset", default="sharegpt", help="'sharegpt', a .jsonl/.json/.parquet file or folder, "
                   "or a hub dataset id")
    p.add_argument("--split", default="train", help="split of a hub dataset")
    p.add_argument("--output-dir", default="data/prepared", help="stage 01 output folder")
    p.add_argument("--max-seq-len", type=int, default=2048, help="truncate each conversation to this many tokens")
    p.add_argument("--num-samples", type=int, default=None, help="use the first N records (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the output row order")
    p.add_argument("--num-workers", type=int, default=None,
                   help="worker processes that render and tokenize the conversations (0: this process, where a "
                        "template stuck in one C call cannot be stopped; default: one under 1,000 records, none with "
                        "--regenerate, else one per CPU core up to 32); the rows are the same for any number")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer's own code (Kimi)")
    p.add_argument("--regenerate", action="store_true",
                   help="the verifier rewrites every assistant turn first: on-policy data")
    p.add_argument("--regen-engine", choices=["auto", "vllm", "hf"], default="auto",
                   help="what runs the verifier for --regenerate: vllm, or hf (transformers, batched by length, on "
                        "a GPU or this CPU: for a cluster without the serving engine); auto: vllm where installed")
    p.add_argument("--regen-samples", type=int, default=1,
                   help="answers sampled per conversation with --regenerate (at --regen-temperature > 0); each "
                        "copy a row of its own, a copy equal to an earlier one left out and counted")
    p.add_argument("--regen-temperature", type=float, default=0.0, help="sampling temperature of --regenerate")
    p.add_argument("--regen-max-tokens", type=int, default=1024, help="longest regenerated turn, in tokens")
    p.add_argument("--regen-batch-size", type=int, default=64,
                   help="prompts per engine call; answers are saved after each call (what a killed run keeps)")
    cli.add_dtype_flag(p, "the verifier (with --regenerate)")
    p.add_argument("--regen-tp-size", type=int, default=1, help="tensor-parallel GPUs for --regenerate")
    return cli.parse_args(p, "prepare", argv, required=["model_path"])


def main():
    args = parse_args()
    log = cli.setup_logging()
    fp, inputs = preparation.check(args)  # every flag and input, in seconds, before the tokenizer loads
    records, n_read, skipped, info = preparation.read_conversations(args, log)
    tok = preparation.tokenizer(args, records)
    out, regen, answers = None, None, None
    if args.regenerate:  # its answers are cached in the folder as they come: it is taken first
        out = outdir.claim("--output-dir", args.output_dir, "prepare", inputs)  # held until the process exits
        records, counts_regen, answers = regenerate.run(records, tok, args, out)
        regen = {"settings": regenerate.settings_of(args), **counts_regen}
        log.info(f"regenerated {counts_regen['turns_regenerated']:,} assistant turns "
                 f"({counts_regen['turns_from_cache']:,} from an earlier run)")
    rows, freq, counts = preparation.tokenize_rows(records, tok, args, fp["vocab_size"], skipped, n_read, log)
    if out is None:  # every refusal the rows can cause came first: a refused run leaves no folder behind
        out = outdir.claim("--output-dir", args.output_dir, "prepare", inputs)
    preparation.write(out, args, fp, rows, freq, counts, skipped, n_read, info, regen, answers, log)


if __name__ == "__main__":
    cli.run(main)
