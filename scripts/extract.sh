#!/usr/bin/env bash
# Stage 02 for operators: the --dry-run preflight in the foreground (seconds; stops here on any problem), then the
# real run under nohup, logging to <output-dir>/extract.log.
#   bash scripts/extract.sh --model-path /models/Kimi-K2.5 --prepared-data data/kimi/prepared \
#        --output-dir data/kimi/hidden_states [any other 02_extract_hidden_states.py flag]
#   bash scripts/extract.sh --config configs/kimi-k2.5-int4.yaml
# Defaults: --tp-size 8 --batch-size 4 (TP_SIZE / BATCH_SIZE override them; explicit flags win over both).
# REPLICAS=N: N data-parallel replicas on this host, replica k on GPUs [k*TP, (k+1)*TP) of the visible ones
#   (CUDA_VISIBLE_DEVICES, else all), each with --shard k/N, its own log <output-dir>/extract.shard-k.log and PID.
#   8 GPUs: REPLICAS=1 (TP 8), REPLICAS=2 (TP 4 each), REPLICAS=8 (TP 1 each); without --tp-size, TP = GPUs / N.
#   The replica that finishes last checks every file and writes manifest.json.
# Prints the PID(s) (also in <output-dir>/extract[.shard-k].pid) and the exact `tail -f` command. Each run is its
# own process group (setsid): `kill -TERM -- -PID` reaches vLLM's engine processes too, which a plain `kill -9 PID`
# would leave holding GPU memory for a while.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
N=${REPLICAS:-1}
[[ $N =~ ^[1-9][0-9]*$ ]] || { echo "error: REPLICAS=$N: expected a positive integer" >&2; exit 2; }
has() { local f=$1; shift; for a in "$@"; do [[ $a == "$f" || $a == "$f="* ]] && return 0; done; return 1; }
has_hf() { local prev=; for a in "$@"; do [[ $a == --backend=hf || ( $prev == --backend && $a == hf ) ]] && return 0; prev=$a; done; return 1; }
if [ "$N" -gt 1 ]; then
  has --shard "$@" && { echo "error: --shard with REPLICAS=$N: the script gives each replica its shard" >&2; exit 2; }
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -ra GPUS <<< "$CUDA_VISIBLE_DEVICES"
  else mapfile -t GPUS < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null || true); fi
  G=${#GPUS[@]}
  TP=${TP_SIZE:-$(( G / N ))}
  for ((i = 1; i <= $#; i++)); do [[ ${!i} == --tp-size ]] && { j=$((i + 1)); TP=${!j}; }; [[ ${!i} == --tp-size=* ]] && TP=${!i#*=}; done
  (( TP >= 1 && N * TP <= G )) || { echo "error: REPLICAS=$N x --tp-size $TP needs $(( N * (TP > 0 ? TP : 1) )) GPUs; $G visible" >&2; exit 2; }
fi
DEFAULTS=()
# the hf backend has no tensor parallelism: no default --tp-size for it
has --tp-size "$@" || has --config "$@" || has_hf "$@" || DEFAULTS+=(--tp-size "${TP:-${TP_SIZE:-8}}")
has --batch-size "$@" || has --config "$@" || DEFAULTS+=(--batch-size "${BATCH_SIZE:-4}")
ARGS=("${DEFAULTS[@]}" "$@")

# The output folder, as the script resolves it (flags, then --config, then the default).
OUT=$("$PY" - "${ARGS[@]}" <<'PYEOF'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("s02", "02_extract_hidden_states.py")
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
from eagle3pipe import cli
try:
    print(m.parse_args(sys.argv[1:]).output_dir)
except cli.UsageError as e:
    print(f"error: {e}", file=sys.stderr); sys.exit(2)
PYEOF
)

group() { local k=$1; (IFS=,; echo "${GPUS[*]:$(( k * TP )):$TP}"); }
echo "extract.sh: preflight (--dry-run) ..."
if [ "$N" -gt 1 ]; then
  CUDA_VISIBLE_DEVICES=$(group 0) "$PY" 02_extract_hidden_states.py "${ARGS[@]}" --shard 0/$N --dry-run
else
  "$PY" 02_extract_hidden_states.py "${ARGS[@]}" --dry-run
fi
mkdir -p "$OUT"
if [ "$N" -eq 1 ]; then
  LOG="$OUT/extract.log"
  setsid nohup "$PY" 02_extract_hidden_states.py "${ARGS[@]}" >>"$LOG" 2>&1 &
  echo $! > "$OUT/extract.pid"
  echo "extract.sh: started PID $!; log: $LOG"
  echo "  tail -f $LOG"
  echo "  stop: kill -TERM -- -$!   (its process group: the batch in flight is finished, vLLM's processes go too)"
  exit 0
fi
for ((k = 0; k < N; k++)); do
  LOG="$OUT/extract.shard-$k.log"
  CUDA_VISIBLE_DEVICES=$(group $k) setsid nohup "$PY" 02_extract_hidden_states.py "${ARGS[@]}" --shard $k/$N >>"$LOG" 2>&1 &
  echo $! > "$OUT/extract.shard-$k.pid"
  echo "extract.sh: replica $k/$N on GPUs $(group $k): PID $!; log: $LOG"
done
echo "  tail -f $OUT/extract.shard-*.log"
echo "  stop one: kill -TERM -- -<its PID> (its process group)"
