#!/usr/bin/env bash
# Stages 01-04 on NVIDIA GPUs: the HF backend of stage 02 on CUDA, then stage 04 on one GPU, then under torchrun
# with speculators' DDP and FSDP on all visible GPUs. Used on the lent H200 machines (see docs/BENCHMARKS.md).
#   bash bench/gpu_proof.sh ASSETS OUT
# ASSETS holds: config.json + tokenizer files of the verifier (weights are drawn at random: this proves the
# mechanics and measures speed, not quality), train.json (ShareGPT conversations), and optionally *.whl for
# packages missing on the machine. OUT receives the logs and a summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."
A=$1; OUT=$2; W=${WORK:-/tmp/gpuproof}; PY=${PYTHON:-python3}
mkdir -p "$OUT" "$W"
if ls "$A"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$A"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')
echo "gpus: $NGPU"
$PY - "$A" "$W/verifier" <<'EOF'
import shutil, sys, os, torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = sys.argv[1], sys.argv[2]
cfg = AutoConfig.from_pretrained(src)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(dst)
for n in os.listdir(src):
    if n.startswith(("tokenizer", "chat_template", "special_tokens", "generation")):
        shutil.copy(os.path.join(src, n), dst)
EOF
M=$W/verifier
s() {  # s NAME CMD...: run CMD, log to OUT/NAME.log, record its wall time
  local name=$1 t0; shift; t0=$(date +%s.%N)
  "$@" > "$OUT/$name.log" 2>&1 || { tail -40 "$OUT/$name.log"; echo "$name failed"; exit 1; }
  grep -E "done:|wrote|coverage|step .*/|Resuming|checkpoint:" "$OUT/$name.log" | tail -4 || true
  awk -v n="$name" -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%s\t%.1f\n", n, b - a }' >> "$OUT/times.tsv"
}
s prepare $PY 01_prepare_dataset.py --model-path $M --dataset "$A/train.json" --max-seq-len 2048 --output-dir $W/prep
s extract_hf_cuda $PY 02_extract_hidden_states.py --backend hf --model-path $M --prepared-data $W/prep \
    --output-dir $W/hs --batch-size 8
s vocab $PY 03_build_vocab_mapping.py --prepared-data $W/prep --draft-vocab-size 8192 --output-dir $W/vocab
T="--model-path $M --prepared-data $W/prep --hidden-states $W/hs --vocab-mapping $W/vocab --epochs 2 --total-seq-len 8192 --log-every 5 ${TRAIN_FLAGS:-}"
CUDA_VISIBLE_DEVICES=0 s train_1gpu $PY 04_train.py $T --output-dir $W/ck1
if [ "$NGPU" -ge 2 ]; then
  s train_ddp $PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" 04_train.py $T --output-dir $W/ckddp
  s train_fsdp $PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" 04_train.py $T --fsdp --output-dir $W/ckfsdp
fi
$PY - "$W" "$OUT" <<'EOF'
import json, os, sys
w, out = sys.argv[1], sys.argv[2]
res = {"extract": json.load(open(f"{w}/hs/manifest.json"))["throughput"], "train": {}}
for ck in ("ck1", "ckddp", "ckfsdp"):
    p = f"{w}/{ck}/manifest.json"
    if os.path.exists(p):
        m = json.load(open(p))
        last = os.path.realpath(f"{w}/{ck}/last")
        cfg = json.load(open(f"{last}/config.json"))
        res["train"][ck] = {"steps": m["steps"], "best_val_loss": m["best_val_loss"], "last": last,
                            "eagle3": cfg["speculators_model_type"], "aux": cfg["eagle_aux_hidden_state_layer_ids"]}
res["times_s"] = dict(l.split("\t") for l in open(f"{out}/times.tsv").read().split("\n") if l.strip())
json.dump(res, open(f"{out}/summary.json", "w"), indent=2)
print("SUMMARY", json.dumps(res))
EOF
