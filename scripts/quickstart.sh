#!/usr/bin/env bash
# The main job on the embedded default, from a fresh machine: SmolLM2-135M-Instruct as the verifier,
# a few hundred ShareGPT conversations, every stage that exists, in order.
#   bash scripts/quickstart.sh            # NUM_SAMPLES=300 by default
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
CFG=configs/smollm2-135m.yaml
N=${NUM_SAMPLES:-300}
start=$(date +%s)
$PY 01_prepare_dataset.py --config $CFG --num-samples "$N"
$PY 03_build_vocab_mapping.py --config $CFG
echo "quickstart: done in $(( $(date +%s) - start )) s after setup"
