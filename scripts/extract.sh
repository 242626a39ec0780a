#!/usr/bin/env bash
# Stage 02 for operators: stage 02's own preflight in the foreground (seconds; stops here, with one line, on any
# problem), then the run in the background, in its own process group, logging to <output-dir>/extract.log.
#   bash scripts/extract.sh --model-path /models/Kimi-K2.5 --prepared-data data/kimi/prepared \
#        --output-dir data/kimi/hidden_states [any other 02_extract_hidden_states.py flag]
#   bash scripts/extract.sh --config configs/kimi-k2.5-int4.yaml
#   bash scripts/extract.sh ... --dry-run          # the preflight only: nothing written, nothing started
#   bash scripts/extract.sh --help                 # stage 02's flags and this script's environment
# Defaults: --tp-size 8 --batch-size 4 (TP_SIZE / BATCH_SIZE override them; explicit flags and --config win over
# both; no --tp-size with --backend hf). PYTHON: the interpreter (default .venv/bin/python).
# REPLICAS=N: N data-parallel replicas on this host, replica k on GPUs [k*TP, (k+1)*TP) of the visible ones
#   (CUDA_VISIBLE_DEVICES, else all), each with --shard k/N, its own log <output-dir>/extract.shard-k.log and PID.
#   8 GPUs: REPLICAS=1 (TP 8), REPLICAS=2 (TP 4 each), REPLICAS=8 (TP 1 each); without --tp-size, TP = GPUs / N.
#   The replica that finishes last checks every file and writes manifest.json.
# The folder is taken as stage 02 takes it (its lock, its ownership record) before anything starts: a second launch
# on it is refused naming the running PID. The log and PID file are never written through a link, and the PID file
# (<output-dir>/extract[.shard-k].pid) is written only once the run holds its folder. It prints the PID(s) and the
# exact `tail -f` command; `kill -TERM -- -PID` stops a run with its vLLM engine processes (its process group).
# The work is done by eagle3pipe/extract/launch.py.
set -euo pipefail
# Relative paths mean what they mean where you are: this script does not change folder (the project's package is
# found through PYTHONPATH, its interpreter by ROOT).
ROOT=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
. "$ROOT/scripts/lib.sh"
PY=${PYTHON:-$ROOT/.venv/bin/python}
if ! command -v "$PY" >/dev/null; then
  [ -n "${PYTHON:-}" ] && fail "PYTHON=" "$PYTHON" "not an executable"
  PY=python3
fi
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 9))' 2>/dev/null \
  || fail "${PYTHON:+PYTHON=}" "$PY" "not a Python 3.9+ interpreter"
# not `python -m`: that puts the current folder first on the module path, and a json.py (or another checkout's
# eagle3pipe/) in the folder you launch from would run in its place
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -c \
  'import sys; sys.path[:] = [p for p in sys.path if p]; from eagle3pipe.config import cli; from eagle3pipe.extract import launch; cli.run(launch.main)' \
  "$@"
