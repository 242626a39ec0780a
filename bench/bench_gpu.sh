#!/usr/bin/env bash
# The GPU benchmarks of docs/BENCHMARKS.md, on a lent H200 machine (bench/ and .gpu/ travel with the tree):
#   bash bench/bench_gpu.sh extract ASSETS OUT   # bench_extract_gpu.py: stage 02 vs bare forward, fp8, 2 replicas
#   bash bench/bench_gpu.sh train   ASSETS OUT   # bench_train.py: stage 04 vs speculators' train, DDP on all GPUs
#   bash bench/bench_gpu.sh gputrain ASSETS OUT  # bench_train_gpu.py: stage 04 as a user sees it (SHAPES=kimi,embedded;
#                                                  PROFILE=10 adds a run with --profile-steps 10; RUNS picks and
#                                                  orders the runs, e.g. RUNS=fresh,profiled,warm@32768; STORAGE=bf16
#                                                  skips the fp8 extraction)
#   bash bench/bench_gpu.sh mla     ASSETS OUT   # bench_mla_draft_gpu.py: the MLA draft against the Llama-style one
#                                                  (ARMS=llama, then ARMS=deepseek: one arm a call)
# ASSETS: tokenizer files + config.json of a small Llama, train.json (ShareGPT), *.whl for what the machine lacks.
# WORK (default /tmp/w) is reused between the two when the machine is still the same one.
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT=$1; A=$(realpath "$2"); OUT=$3; W=${WORK:-/tmp/w}; PY=${PYTHON:-python3}
mkdir -p "$OUT" "$W"
if ls "$A"/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site ]; then  # only what the machine lacks: its own versions stay
  $PY - "$A" <<'EOF'
import glob, importlib.metadata as md, subprocess, sys
missing = []
for w in sorted(glob.glob(sys.argv[1] + "/*.whl")):
    try:
        md.version(w.split("/")[-1].split("-")[0].replace("_", "-"))
    except md.PackageNotFoundError:
        missing.append(w)
subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                "--no-cache-dir", "--target", "/tmp/site", *missing], check=True)
EOF
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -2; df -h "$W" | tail -1; nproc
if [ "$WHAT" = mla ]; then
  $PY -m bench.bench_mla_draft_gpu --assets "$A" --work "$W/mla" --out "$OUT" --arms "${ARMS:-llama,deepseek}" | tee "$OUT/mla.txt"
  exit 0
fi
if [ "$WHAT" = gputrain ]; then  # SHAPES: kimi,embedded (one a call keeps each under the 10-minute limit)
  $PY -m bench.bench_train_gpu --assets "$A" --work "$W/gt" --out "$OUT" --shapes "${SHAPES:-kimi,embedded}" \
    --hs-dir /dev/shm --profile "${PROFILE:-0}" --storage "${STORAGE:-bf16,fp8}" ${RUNS:+--runs "$RUNS"} \
    | tee "$OUT/gputrain.txt"
  exit 0
fi
if [ "$WHAT" = extract ]; then
  $PY -m bench.bench_extract_gpu --assets "$A" --work "$W" --num-samples "${SAMPLES:-1000}" | tee "$OUT/extract.txt"
  exit 0
fi
M=$W/verifier
trap 'cp $W/bt/*.log "$OUT/" 2>/dev/null || true' EXIT
[ -f "$M/config.json" ] || $PY -c "import sys; sys.path.insert(0, 'bench'); import bench_extract_gpu as b; b.make_verifier('$A', '$M')"
if [ ! -f "$W/tprep/manifest.json" ]; then
  $PY 01_prepare_dataset.py --model-path $M --dataset "$A/train.json" --num-samples "${TRAIN_SAMPLES:-400}" \
      --max-seq-len 2048 --output-dir $W/tprep > "$OUT/t01.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 $PY 02_extract_hidden_states.py --backend hf --model-path $M --prepared-data $W/tprep \
      --output-dir $W/ths --batch-size 8 > "$OUT/t02.log" 2>&1
fi
$PY 03_build_vocab_mapping.py --prepared-data $W/tprep --draft-vocab-size 32000 --output-dir $W/tvocab > "$OUT/t03.log" 2>&1
DDP=0; [ "$NGPU" -ge 2 ] && DDP=$NGPU
# plain `python 04_train.py` (and speculators' command) train on GPU 0; --ddp adds torchrun on all GPUs
$PY -m bench.bench_train --model-path $M --prepared-data $W/tprep --hidden-states $W/ths --vocab-mapping $W/tvocab \
    --work $W/bt --steps "${STEPS:-60}" --total-seq-len 8192 --ddp $DDP \
    -- ${TRAIN_FLAGS:---loss-implementation eager} | tee "$OUT/train.txt"
cp $W/bt/*.log "$OUT/" 2>/dev/null || true
