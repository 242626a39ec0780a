"""Stage 03: verifier vocab -> draft vocab (e.g. 163,840 -> 32,000) from loss-masked token counts.

Usage:
    python 03_build_vocab_mapping.py --prepared-data data/prepared --draft-vocab-size 8192
    python 03_build_vocab_mapping.py --config configs/kimi-k2.5-int4.yaml

Inputs:  --prepared-data: stage 01 folder (token_freq.npy + manifest.json).
Outputs: --output-dir (default data/vocab_map_<K>: the name carries the size, so a stale map is never
         picked up by accident):
           d2t.npy   int64 [K]  draft id i -> verifier id i + d2t[i]  (what vLLM and speculators use)
           t2d.npy   bool  [V]  True where a verifier token is in the draft vocab
           manifest.json        arguments, verifier fingerprint, coverage, versions, command
Prints the fraction of loss-masked training tokens the draft vocab covers. The output folder must be new, empty or an
earlier stage 03 output: only this stage's own files are replaced.
"""
import os
import re

from eagle3pipe.config import cli
from eagle3pipe.storage import files, outdir


def parse_args(argv=None):
    p = cli.Parser(description="Stage 03: build the draft vocabulary mapping (d2t / t2d).")
    p.add_argument("--prepared-data", default="data/prepared", help="stage 01 output folder")
    p.add_argument("--draft-vocab-size", type=int, default=32000, help="K: tokens in the draft vocab")
    p.add_argument("--output-dir", default=None, help="output folder (default: data/vocab_map_<K>)")

    def derive(ns):
        if ns.output_dir is None:
            ns.output_dir = f"data/vocab_map_{ns.draft_vocab_size}"
    return cli.parse_args(p, "vocab", argv, derive=derive)


def main():
    args = parse_args()
    log = cli.setup_logging()
    prep = files.load_stage("--prepared-data", args.prepared_data, "prepare")
    inputs = [("--prepared-data", args.prepared_data)]
    outdir.check("--output-dir", args.output_dir, "vocab", inputs)
    vocab, manifest = prep["verifier"]["vocab_size"], os.path.join(args.prepared_data, files.MANIFEST)
    if vocab < 1:
        raise cli.UsageError(f"{manifest}: field 'vocab_size' of 'verifier' is {vocab}, not a vocabulary size; rerun "
                             f"01_prepare_dataset.py")
    if not 1 <= args.draft_vocab_size <= vocab:
        raise cli.UsageError(f"--draft-vocab-size {args.draft_vocab_size}: must be between 1 and the verifier "
                             f"vocab size {vocab}")
    named = re.search(r"(\d{3,})$", os.path.basename(os.path.normpath(args.output_dir)))
    if named and int(named.group(1)) != args.draft_vocab_size:  # a config's folder, another size by flag
        log.warning(f"--output-dir {args.output_dir}: its name says {int(named.group(1)):,} tokens; this map has "
                    f"{args.draft_vocab_size:,} (its manifest says so, and stage 04 reads that)")

    import numpy as np
    from eagle3pipe.prepare.vocab import build_mapping
    freq_path = os.path.join(args.prepared_data, "token_freq.npy")
    try:
        freq = files.load_npy(freq_path)
    except (OSError, ValueError) as e:
        raise cli.UsageError(f"{freq_path}: unreadable ({e}); rerun 01_prepare_dataset.py")
    if freq.ndim != 1 or freq.shape[0] != vocab or not np.issubdtype(freq.dtype, np.integer):
        raise cli.UsageError(f"{freq_path}: expected int64 [{vocab}], got {freq.dtype} {list(freq.shape)}; "
                             f"rerun 01_prepare_dataset.py")
    if (freq < 0).any():
        raise cli.UsageError(f"{freq_path}: holds negative counts (token id {int(np.argmax(freq < 0))}): not stage 01's "
                             f"file; rerun 01_prepare_dataset.py")
    if int(freq.sum()) != prep["counts"]["loss_tokens"]:
        raise cli.UsageError(f"{freq_path}: counts {int(freq.sum()):,} loss-masked tokens, its folder's {files.MANIFEST} "
                             f"{prep['counts']['loss_tokens']:,}: not this run's file; rerun 01_prepare_dataset.py")
    if "token_freq_id" in prep and files.array_id(freq) != prep["token_freq_id"]:  # counts moved, sum kept
        raise cli.UsageError(f"{freq_path}: changed since stage 01 wrote it (content id {files.array_id(freq)}, its "
                             f"folder's {files.MANIFEST} says {prep['token_freq_id']}); rerun 01_prepare_dataset.py")
    d2t, t2d, coverage = build_mapping(freq, args.draft_vocab_size)

    out = outdir.claim("--output-dir", args.output_dir, "vocab", inputs)
    files.begin_output(out)
    files.save_npy(os.path.join(out, "d2t.npy"), d2t)
    files.save_npy(os.path.join(out, "t2d.npy"), t2d)
    files.write_json(os.path.join(out, files.MANIFEST), files.manifest(
        "vocab", args, content_id=files.content_id([d2t.tolist(), prep["content_id"]]), verifier=prep["verifier"],
        prepared_data=os.path.abspath(args.prepared_data), d2t_id=files.array_id(d2t),
        counts={"verifier_vocab_size": vocab, "draft_vocab_size": args.draft_vocab_size,
                "tokens_seen": int((freq > 0).sum()), "loss_tokens": int(freq.sum()), "coverage": coverage}))
    log.info(f"draft vocab {args.draft_vocab_size:,} of {vocab:,} verifier tokens ({int((freq > 0).sum()):,} "
             f"seen in training) covers {coverage:.2%} of the {int(freq.sum()):,} loss-masked tokens -> "
             f"{args.output_dir}")
    print(f"coverage: {coverage:.4f}")


if __name__ == "__main__":
    cli.run(main)
