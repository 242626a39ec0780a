#!/usr/bin/env bash
# The main job on the embedded default, from a fresh machine: SmolLM2-135M-Instruct as the verifier and a few
# hundred ShareGPT conversations through every stage, then the acceptance table.
#   bash scripts/quickstart.sh                       # NUM_SAMPLES=300 EPOCHS=1
#   NUM_SAMPLES=2000 EPOCHS=3 bash scripts/quickstart.sh
# Outputs under data/ (prepared, hidden_states, vocab_map_8192, checkpoints, eval); a rerun resumes or
# replaces each stage's own folder.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
CFG=configs/smollm2-135m.yaml
N=${NUM_SAMPLES:-300}
start=$(date +%s)
stamp() { echo "quickstart: $1 done at +$(( $(date +%s) - start )) s"; }
$PY 01_prepare_dataset.py --config $CFG --num-samples "$N";          stamp "01 prepare"
$PY 02_extract_hidden_states.py --config $CFG;                      stamp "02 extract"
$PY 03_build_vocab_mapping.py --config $CFG;                         stamp "03 vocab map"
$PY 04_train.py --config $CFG --epochs "${EPOCHS:-1}";               stamp "04 train"
$PY 05_evaluate.py --config $CFG --draft data/checkpoints/last --num-prompts "${NUM_PROMPTS:-8}" \
    --max-new-tokens 64 --batch-sizes 1,4;                           stamp "05 evaluate"
echo "quickstart: the draft is data/checkpoints/last; serve it with vLLM:"
echo "  $($PY -c 'from eagle3pipe.engine import serve_command as s; print(s("data/models/smollm2-135m-instruct", "data/checkpoints/last", 3))')"
