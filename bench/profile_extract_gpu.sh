#!/usr/bin/env bash
# Where stage 02's time goes on a GPU at Kimi's width (4 layers, the slice that measured 0.79x of a bare forward):
# py-spy samples every thread, idle ones included, of one HF-backend run; plus the disk's own write speed.
#   bash bench/profile_extract_gpu.sh ASSETS OUT      (py-spy among the carried wheels, in /tmp/site/bin)
set -euo pipefail
cd "$(dirname "$0")/.."
A=$1; OUT=$2; W=${WORK:-/tmp/p}; PY=${PYTHON:-python3}
mkdir -p "$W" "$OUT"
grep -E "MemTotal|MemFree|Dirty" /proc/meminfo; cat /proc/sys/vm/dirty_ratio /proc/sys/vm/dirty_background_ratio
dd if=/dev/zero of=$W/ddtest bs=1M count=6000 oflag=direct 2>&1 | tail -1; rm -f $W/ddtest
$PY -c "import sys; sys.path.insert(0, 'bench'); import bench_kimi_gpu as b; b.make_verifier('$A', '$W/v4', 4, 16, 8)"
$PY 01_prepare_dataset.py --model-path $W/v4 --dataset "$A/train.json" --num-samples 250 --max-seq-len 2048 \
    --output-dir $W/prep > "$OUT/p01.log" 2>&1
/tmp/site/bin/py-spy record --format raw --rate 50 --threads --idle -o "$OUT/prof.txt" -- \
    $PY 02_extract_hidden_states.py --backend hf --model-path $W/v4 --prepared-data $W/prep --output-dir $W/hs \
    --layer-ids 1,2,3 --batch-size 8 > "$OUT/p02.log" 2>&1 || { tail -20 "$OUT/p02.log"; exit 1; }
grep -E "done:" "$OUT/p02.log"
