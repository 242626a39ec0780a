#!/usr/bin/env bash
# Stage 02 for operators: the --dry-run preflight in the foreground (seconds; stops here on any problem),
# then the real run under nohup, logging to <output-dir>/extract.log.
#   bash scripts/extract.sh --model-path /models/Kimi-K2.5 --prepared-data data/kimi/prepared \
#        --output-dir data/kimi/hidden_states [any other 02_extract_hidden_states.py flag]
#   bash scripts/extract.sh --config configs/kimi-k2.5-int4.yaml
# Defaults: --tp-size 8 --batch-size 4 (TP_SIZE / BATCH_SIZE override them; explicit flags win over both).
# Prints the PID (also in <output-dir>/extract.pid) and the exact `tail -f` command.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEFAULTS=()
has() { local f=$1; shift; for a in "$@"; do [[ $a == "$f" || $a == "$f="* ]] && return 0; done; return 1; }
has --tp-size "$@" || has --config "$@" || DEFAULTS+=(--tp-size "${TP_SIZE:-8}")
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

echo "extract.sh: preflight (--dry-run) ..."
"$PY" 02_extract_hidden_states.py "${ARGS[@]}" --dry-run
mkdir -p "$OUT"
LOG="$OUT/extract.log"
nohup "$PY" 02_extract_hidden_states.py "${ARGS[@]}" >>"$LOG" 2>&1 &
PID=$!
echo "$PID" > "$OUT/extract.pid"
echo "extract.sh: started PID $PID; log: $LOG"
echo "  tail -f $LOG"
