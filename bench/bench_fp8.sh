#!/usr/bin/env bash
# fp8 against bf16 storage on one run: the same stage 01 rows, extracted twice by stage 02 (vLLM backend), one
# vocabulary, two drafts trained with the same seed and flags, both evaluated by 05_evaluate.py on the same
# held-out prompts. Prints disk per token and the acceptance lengths.
#   bash bench/bench_fp8.sh PREPARED WORK [EPOCHS=1] [PROMPTS=20]
# PREPARED: a stage 01 folder of the embedded SmolLM2 (e.g. the one bench_extract_cpu.py leaves); reuses
# WORK/hs_bf16 if the caller already extracted it there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python; M=data/models/smollm2-135m-instruct
P=$1; W=$2; EPOCHS=${3:-1}; N=${4:-20}
mkdir -p "$W"
for s in bf16 fp8; do
  $PY 02_extract_hidden_states.py --model-path $M --prepared-data "$P" --output-dir "$W/hs_$s" --storage-dtype $s \
      --batch-size 4 > "$W/extract_$s.log" 2>&1
done
$PY 03_build_vocab_mapping.py --prepared-data "$P" --draft-vocab-size 8192 --output-dir "$W/vocab" > "$W/vocab.log" 2>&1
for s in bf16 fp8; do
  t0=$(date +%s)
  $PY 04_train.py --model-path $M --prepared-data "$P" --hidden-states "$W/hs_$s" --vocab-mapping "$W/vocab" \
      --output-dir "$W/ck_$s" --epochs "$EPOCHS" --total-seq-len 2048 --seed 0 > "$W/train_$s.log" 2>&1
  echo "train_$s $(( $(date +%s) - t0 )) s"
  $PY 05_evaluate.py --model-path $M --draft "$W/ck_$s/last" --prepared-data "$P" --num-prompts "$N" \
      --max-new-tokens 128 --batch-sizes 1 --output-dir "$W/eval_$s" > "$W/eval_$s.log" 2>&1
done
$PY - "$W" "$P" <<'PYEOF'
import json, sys
w, p = sys.argv[1], sys.argv[2]
tokens = json.load(open(f"{p}/manifest.json"))["counts"]["tokens"]
res = {}
for s in ("bf16", "fp8"):
    ext = json.load(open(f"{w}/hs_{s}/manifest.json"))
    rep = json.load(open(f"{w}/eval_{s}/report.json"))
    res[s] = {"bytes": ext["counts"]["bytes"], "bytes_per_token": round(ext["counts"]["bytes"] / tokens, 1),
              "extract_tok_s": ext["throughput"]["tokens_per_s"], "acceptance_length": rep["acceptance_length"],
              "per_position": rep["speculative"]["1"].get("per_position") if "1" in rep["speculative"] else None}
print("RESULT " + json.dumps(res, default=str))
PYEOF
