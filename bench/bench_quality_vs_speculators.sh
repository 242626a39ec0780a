#!/usr/bin/env bash
# Quality benchmark (issue 5): the same verifier (SmolLM2), the same ShareGPT conversations, the same draft shape,
# epochs, lr and packing, through (a) this pipeline and (b) speculators' own command-line pipeline
# (bench/speculators_pipeline.sh), both evaluated by 05_evaluate.py on the same held-out prompts.
#   bash bench/bench_quality_vs_speculators.sh [N_CONVERSATIONS=200] [EPOCHS=2] [WORK=/tmp/bench-quality]
# Writes WORK/summary.json (acceptance lengths, per-position rates, stage wall times) and prints it.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-200}; EPOCHS=${2:-2}; WORK=${3:-/tmp/bench-quality}
LR=${LR:-3e-3}; SEQ=2048; TOTAL=2048; VOCAB=8192; PROMPTS=${PROMPTS:-20}; NEW=${NEW_TOKENS:-96}
PY=.venv/bin/python
# WORK is replaced only when this bench made it (its mark inside, not a link): never a folder of the user's
if [ -e "$WORK" ] || [ -L "$WORK" ]; then
  { [ ! -L "$WORK" ] && [ -f "$WORK/.bench-quality-made" ]; } \
    || { echo "error: WORK=$WORK exists and was not made by this bench; give a new folder" >&2; exit 2; }
  rm -rf -- "$WORK"
fi
mkdir -p "$WORK/ours" && touch "$WORK/.bench-quality-made"
# The first N ShareGPT conversations as a valid JSON file (the package's file is truncated mid-record), and the
# next PROMPTS as held-out prompts for both evaluations.
$PY - "$N" "$PROMPTS" "$WORK" <<'EOF'
import json, sys
sys.path.insert(0, ".")
from eagle3pipe.chat.conversations import iter_records
n, p, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
recs = []
for _, r in iter_records("sharegpt"):
    recs.append(r)
    if len(recs) >= n + p:
        break
json.dump(recs[:n], open(f"{work}/train.json", "w"))
with open(f"{work}/heldout.jsonl", "w") as f:
    for r in recs[n:]:
        f.write(json.dumps(r) + "\n")
EOF
t() { local name=$1 t0; shift; t0=$(date +%s); "$@"; echo -e "$name\t$(( $(date +%s) - t0 ))" >> "$WORK/ours/times.txt"; }
M=data/models/smollm2-135m-instruct
O=$WORK/ours
t prepare  $PY 01_prepare_dataset.py --model-path $M --dataset "$WORK/train.json" --max-seq-len $SEQ --output-dir $O/prepared
t extract  $PY 02_extract_hidden_states.py --model-path $M --prepared-data $O/prepared --output-dir $O/hs --max-seq-len $SEQ
t vocab    $PY 03_build_vocab_mapping.py --prepared-data $O/prepared --draft-vocab-size $VOCAB --output-dir $O/vocab
t train    $PY 04_train.py --model-path $M --prepared-data $O/prepared --hidden-states $O/hs --vocab-mapping $O/vocab \
               --output-dir $O/ckpt --epochs "$EPOCHS" --lr "$LR" --total-seq-len $TOTAL
TOTAL_SEQ_LEN=$TOTAL bash bench/speculators_pipeline.sh "$WORK/train.json" "$WORK/spec" $SEQ "$EPOCHS" $VOCAB "$LR"
SPEC_CKPT=$(readlink -f "$WORK/spec/checkpoints/last" || ls -d "$WORK"/spec/checkpoints/[0-9]* | sort -V | tail -1)
for who in ours spec; do
  ck=$O/ckpt/last; [ $who = spec ] && ck=$SPEC_CKPT
  $PY 05_evaluate.py --model-path $M --draft "$ck" --prompts "$WORK/heldout.jsonl" --num-prompts "$PROMPTS" \
      --max-new-tokens "$NEW" --batch-sizes 1,8 --output-dir "$WORK/eval_$who"
done
$PY - "$WORK" <<'EOF'
import json, sys
w = sys.argv[1]
out = {}
for who, times in (("ours", f"{w}/ours/times.txt"), ("speculators", f"{w}/spec/times.txt")):
    rep = json.load(open(f"{w}/eval_{'ours' if who == 'ours' else 'spec'}/report.json"))
    out[who] = {"acceptance_length": rep["acceptance_length"],
                "per_position_b8": rep["speculative"]["8"]["per_position"],
                "acceptance_length_b1": rep["speculative"]["1"]["acceptance_length"],
                "speedup": rep["speedup"],
                "times_s": dict(l.split("\t")[:2] for l in open(times).read().split("\n") if l.strip() and not l.startswith("#"))}
json.dump(out, open(f"{w}/summary.json", "w"), indent=2)
print("SUMMARY " + json.dumps(out))
EOF
