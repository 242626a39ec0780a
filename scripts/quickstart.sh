#!/usr/bin/env bash
# The main job on the embedded default, from a fresh machine: SmolLM2-135M-Instruct as the verifier and up to 300
# ShareGPT conversations through every stage, then the acceptance table.
#   bash scripts/quickstart.sh                       # up to 300 conversations, 1 epoch, fitted to ~25 minutes
#   NUM_SAMPLES=2000 EPOCHS=3 bash scripts/quickstart.sh   # exactly these, however long they take
#   bash scripts/quickstart.sh --dry-run             # what it would do on this machine; nothing installed or run
# With an NVIDIA GPU (nvidia-smi lists one) it trains on all the package's conversations but the last 1,000 (kept
# for stage 05's 100 held-out prompts), hidden states stored in fp8 (about 55 GB of disk), with the recipe
# docs/RECIPE.md measured best at that size (a 32,768-token draft vocabulary, two draft layers; 8 epochs at 32,768
# tokens a step on a GPU of 40 GB or more, else 3 at 8,192), and says so before it starts; NUM_SAMPLES / EPOCHS /
# NUM_PROMPTS still choose.
# Before the run it measures this machine (one forward of the verifier, ~10 s) and prints what each stage will
# take. On a slow CPU it trains on fewer conversations so the run fits BUDGET_MIN minutes (default 24, for stages
# 02-05), and says so; NUM_SAMPLES fixes the number. Every stage computes in the dtype that is fast here (bf16
# where the CPU has it natively, float32 elsewhere: eagle3pipe/base/compute.py). vLLM's own output goes to each stage
# folder's engine.log.
# Outputs under data/ (prepared, hidden_states, vocab_map_8192 or with a GPU vocab_map_32768, checkpoints, eval);
# a rerun resumes or replaces each stage's own folder. NUM_SAMPLES, EPOCHS, NUM_PROMPTS: whole numbers >= 1;
# BUDGET_MIN: minutes > 0 (anything else, nan and inf included, is refused in one line before anything runs).
# A TERM, INT or HUP sent to this script stops the stage it is running too (scripts/lib.sh).
set -euo pipefail
CDPATH= cd -- "$(dirname -- "$0")/.."
. scripts/lib.sh
DRY=0
case $# in
  0) ;;
  1) [ "$1" = --dry-run ] || fail "argument " "$1" "expected nothing or --dry-run (the plan for this machine, nothing run)"
     DRY=1 ;;
  *) fail "arguments " "$*" "expected nothing or --dry-run" ;;
esac
whole() { [[ -z ${!1:-} || ${!1} =~ ^[1-9][0-9]{0,8}$ ]] || fail "$1=" "${!1}" "expected a whole number >= 1"; }
for v in NUM_SAMPLES EPOCHS NUM_PROMPTS; do whole $v; done
if [[ -n ${BUDGET_MIN:-} ]] && ! [[ $BUDGET_MIN =~ ^([0-9]{1,6}(\.[0-9]*)?|\.[0-9]+)$ && $BUDGET_MIN =~ [1-9] ]]; then
  fail "BUDGET_MIN=" "$BUDGET_MIN" "expected a number of minutes > 0 (e.g. 24 or 7.5)"
fi
PY=.venv/bin/python
CFG=configs/smollm2-135m.yaml
MODEL=data/models/smollm2-135m-instruct
# what the user set stays apart from each machine's defaults (one variable for both once gave a GPU 1 epoch, not 3)
GPU=0; STATES=(); DRAFT_VOCAB=8192; LAYERS=(); TOKENS=""; EPOCHS_RUN=${EPOCHS:-1}; PROMPTS=${NUM_PROMPTS:-8}
if command -v nvidia-smi >/dev/null 2>&1 && timeout 10 nvidia-smi -L >/dev/null 2>&1; then
  # at all the conversations a 32,768-token vocabulary and a second layer each add acceptance (docs/RECIPE.md); at
  # the CPU's few hundred the config's 8,192 and one layer stay. Tokens a step and epochs follow the GPU's memory:
  # 8 epochs at 32,768 tokens a step (the best measured, about 21 GiB in training) on a GPU of 40 GB or more;
  # else 3 at 8,192 (activations a quarter as large). The smallest GPU listed decides; a memory nvidia-smi cannot
  # read counts as too small.
  GPU=1; STATES=(--storage-dtype fp8); DRAFT_VOCAB=32768; LAYERS=(--num-layers 2); PROMPTS=${NUM_PROMPTS:-100}
  mib=$(timeout 10 nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | sort -n | head -1) \
    || mib=""
  if [[ $mib =~ ^[0-9]+$ ]]; then mem="$mib MiB"; else mem="its memory unread"; mib=0; fi
  if [ "$mib" -ge 38000 ]; then TOKENS=32768; EPOCHS_RUN=${EPOCHS:-8}
  else TOKENS=8192; EPOCHS_RUN=${EPOCHS:-3}; mem="$mem: under the 40 GB for 32,768 tokens a step"; fi
  echo "quickstart: an NVIDIA GPU ($mem): training on ${NUM_SAMPLES:-all but the last 1,000 of the package}" \
       "ShareGPT conversations (the last 1,000 kept for the evaluation), $EPOCHS_RUN epochs, a two-layer draft with" \
       "a 32,768-token vocabulary, ${TOKENS%???},${TOKENS: -3} tokens a step, hidden states in fp8 (about 55 GB of" \
       "disk for all of them); on a CPU the quickstart fits ~25 minutes instead"
else
  fits="fewer where this CPU cannot run them in ${BUDGET_MIN:-24} minutes"
  [ -n "${NUM_SAMPLES:-}" ] && fits="exactly these, however long they take"
  echo "quickstart: no NVIDIA GPU: ${NUM_SAMPLES:-up to 300} ShareGPT conversations ($fits), $EPOCHS_RUN epoch(s)"
fi
[ $DRY = 1 ] && { echo "quickstart: --dry-run: nothing run"; exit 0; }
run bash scripts/setup.sh
if [ $GPU = 1 ]; then
  total=$($PY -c 'from eagle3pipe.chat.conversations import iter_records as r; print(sum(1 for _ in r("sharegpt")))')
  N=${NUM_SAMPLES:-$((total - 1000))}
else
  N=${NUM_SAMPLES:-300}
fi
# a rerun keeps the earlier run's size (so stage 02 and 04 resume instead of refusing another run's folder)
prev=$($PY -c 'import json; print(json.load(open("data/prepared/manifest.json"))["args"]["num_samples"])' 2>/dev/null || true)
if [ -z "${NUM_SAMPLES:-}" ] && [ -n "$prev" ] && [ "$prev" != None ]; then N=$prev; fi
VOCAB=data/vocab_map_$DRAFT_VOCAB
start=$(date +%s)
stamp() { echo "quickstart: $1 done at +$(( $(date +%s) - start )) s"; }
echo "quickstart: $N ShareGPT conversations${prev:+ (as the earlier run)} -> SmolLM2's chat template (01) -> its" \
     "hidden states (02) -> a draft vocabulary (03) -> $EPOCHS_RUN epoch(s) of EAGLE-3 training (04) -> acceptance on" \
     "$PROMPTS held-out prompts (05)"
run $PY 01_prepare_dataset.py --config $CFG --num-samples "$N";          stamp "01 prepare"
budget=(); [ -z "${NUM_SAMPLES:-}" ] && [ -z "$prev" ] && [ $GPU = 0 ] && budget=(--budget-min "${BUDGET_MIN:-24}")
fit=""
if [ $GPU = 0 ]; then  # the CPU path measures this machine and fits the budget; a GPU takes everything
  rc=0
  fit=$($PY -m eagle3pipe.evaluate.estimate --model-path $MODEL --prepared-data data/prepared --samples "$N" \
        --epochs "$EPOCHS_RUN" --num-prompts "$PROMPTS" --max-new-tokens 64 --batch-sizes 1,4 ${budget[@]+"${budget[@]}"}) \
    || rc=$?
  [ "$rc" -eq 2 ] && exit 2  # a refusal (its line is above): never a run of another size than asked
  [ "$rc" -ne 0 ] && { echo "quickstart: the estimate failed (above); keeping $N conversations" >&2; fit=""; }
fi
if [[ "$fit" =~ ^[0-9]+$ ]] && [ "$fit" -lt "$N" ]; then
  N=$fit
  run $PY 01_prepare_dataset.py --config $CFG --num-samples "$N";    stamp "01 prepare ($N conversations)"
fi
run $PY 02_extract_hidden_states.py --config $CFG ${STATES[@]+"${STATES[@]}"}; stamp "02 extract"
run $PY 03_build_vocab_mapping.py --config $CFG --draft-vocab-size $DRAFT_VOCAB --output-dir $VOCAB
stamp "03 vocab map"
run $PY 04_train.py --config $CFG --epochs "$EPOCHS_RUN" --vocab-mapping $VOCAB ${LAYERS[@]+"${LAYERS[@]}"} \
    ${TOKENS:+--total-seq-len "$TOKENS"}
stamp "04 train"
run $PY 05_evaluate.py --config $CFG --draft data/checkpoints/last --num-prompts "$PROMPTS" \
    --max-new-tokens 64 --batch-sizes 1,4;                       stamp "05 evaluate"
serve=$($PY -c 'import sys; from eagle3pipe.engines.engine import serve_command as s; print(s(sys.argv[1], sys.argv[2], 3))' \
        "$MODEL" data/checkpoints/last)
echo "quickstart: the draft is data/checkpoints/last; serve it with vLLM:"
echo "  $serve"
if [ $GPU = 0 ]; then  # the verdict above is this run's; what the recipe reaches at full size, for scale
  echo "quickstart: this CPU run trained on $N conversations for $EPOCHS_RUN epoch(s) to fit its time; the GPU path's" \
       "draft (all the package's conversations, two layers, 8 epochs) measured an acceptance length of 2.72 and 2.74" \
       "(two seeds) through vLLM on 100 held-out prompts (docs/RECIPE.md)"
fi
