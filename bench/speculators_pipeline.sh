#!/usr/bin/env bash
# speculators' OWN pipeline, end to end on this CPU machine, as the baseline for a comparison with ours:
#   vLLM server (extract_hidden_states + hidden-states KV connector + render endpoint)
#   -> speculators prepare-data -> speculators generate-offline-data -> (server stopped) -> speculators train
# Usage: bench/speculators_pipeline.sh DATA.json|.jsonl WORK_DIR [SEQ_LEN=2048] [EPOCHS=2] [DRAFT_VOCAB=8192] [LR=3e-3]
#                                      [more `speculators train` flags, e.g. --max-steps 50; they override ours]
# Env: MODEL (default: the embedded SmolLM2-135M-Instruct), PORT (18080), CONCURRENCY (4: vLLM batch and requests
# in flight), TOTAL_SEQ_LEN (4096: tokens per packed training step), MAX_SAMPLES (unset: all; counts prepared rows,
# i.e. assistant turns, not conversations), STOP_AFTER_EXTRACT (set: stop after generate-offline-data). Writes <WORK_DIR>/times.txt (seconds per stage) and stats.txt.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=$REPO/.venv/bin/python
[ $# -ge 2 ] || { sed -n 2,9p "$0"; exit 2; }
DATA=$(realpath -e "$1"); WORK=$(realpath -m "$2")
SEQ=${3:-2048}; EPOCHS=${4:-2}; VOCAB=${5:-8192}; LR=${6:-3e-3}
shift $(( $# < 6 ? $# : 6 ))   # what is left goes to `speculators train`
MODEL=$(realpath -e "${MODEL:-$REPO/data/models/smollm2-135m-instruct}")
PORT=${PORT:-18080}; CONC=${CONCURRENCY:-4}; TOTAL=${TOTAL_SEQ_LEN:-4096}
URL=http://127.0.0.1:$PORT     # loopback only
PREP=$WORK/prepared            # prepare-data's Arrow dataset + token_freq.pt; hidden_states/ and d2t/t2d-<K>.npy land here too
STAGING=$WORK/vllm_staging     # the connector writes <request id>.safetensors here; generate-offline-data moves them
CKPT=$WORK/checkpoints; LOG=$WORK/logs; TIMES=$WORK/times.txt
[ ! -e "$TIMES" ] || { echo "$WORK holds an earlier run; use a fresh work dir" >&2; exit 2; }
mkdir -p "$WORK" "$STAGING" "$LOG"

# vLLM on CPU (as eagle3pipe/engines/engine.py sets it): every core for the worker, none reserved; the CPU connector is imported from
# this repo by the spawned engine processes. No network: local model, loopback server.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}
export VLLM_CPU_NUM_OF_RESERVED_CPU=0
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost

now() { date +%s.%N; }
timed() {  # timed NAME CMD...: run CMD; append "NAME <tab> seconds" to times.txt
    local name=$1 t0; shift; t0=$(now)
    "$@"
    awk -v n="$name" -v a="$t0" -v b="$(now)" 'BEGIN { printf "%s\t%.1f\n", n, b - a }' | tee -a "$TIMES"
}

# Layer ids: speculators' defaults [2, n//2, n-3] for training; the server also captures n (the last layer),
# as speculators' scripts/launch_vllm.py does.
N=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1] + "/config.json"))["num_hidden_layers"])' "$MODEL")
AUX="2 $((N / 2)) $((N - 3))"
SPEC="{\"method\": \"extract_hidden_states\", \"num_speculative_tokens\": 1, \"draft_model_config\": {\"hf_config\": {\"eagle_aux_hidden_state_layer_ids\": [${AUX// /, }, $N]}}}"
KV="{\"kv_connector\": \"CPUHiddenStatesConnector\", \"kv_connector_module_path\": \"eagle3pipe.engines.cpu_connector\", \"kv_role\": \"kv_producer\", \"kv_connector_extra_config\": {\"shared_storage_path\": \"$STAGING\"}}"

SERVER_PID=
stop_server() {  # TERM the server's process group (API server + engine core), then KILL what is left
    [ -n "$SERVER_PID" ] || return 0
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=
}
trap stop_server EXIT
trap 'exit 130' INT TERM
wait_server() {  # poll /health until the engine is loaded (the app only serves once it is)
    for _ in $(seq 900); do
        curl -sf --noproxy '*' "$URL/health" >/dev/null && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || { tail -n 40 "$LOG/vllm_server.log" >&2; echo "vLLM server died" >&2; return 1; }
        sleep 1
    done
    echo "vLLM server not healthy after 900 s; see $LOG/vllm_server.log" >&2; return 1
}

T0=$(now)
printf '# data=%s seq=%s epochs=%s draft_vocab=%s lr=%s total_seq_len=%s concurrency=%s\n' \
    "$DATA" "$SEQ" "$EPOCHS" "$VOCAB" "$LR" "$TOTAL" "$CONC" > "$TIMES"
! curl -sf --noproxy '*' "$URL/health" >/dev/null || { echo "port $PORT already serves something" >&2; exit 1; }

# 1. One server for both stages. `vllm serve` fails in vllm-cpu (its distribution is named vllm-cpu), so the
# launcher module with serve's arguments; it ignores a positional model, hence --model. --enable-scale-out adds
# /v1/chat/completions/render; max-model-len = seq + 1 (else renders reaching seq are dropped, and prompts of seq
# tokens need room for the one generated token). Prefix caching off: cached blocks would be missing from the files.
setsid "$PY" -m vllm.entrypoints.launchers.api_server.entry \
    --model "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype bfloat16 \
    --max-model-len $((SEQ + 1)) --max-num-seqs "$CONC" \
    --max-num-batched-tokens $(( CONC * SEQ > SEQ + 1 ? CONC * SEQ : SEQ + 1 )) \
    --enforce-eager --no-enable-prefix-caching --enable-scale-out --disable-uvicorn-access-log \
    --speculative-config "$SPEC" --kv-transfer-config "$KV" > "$LOG/vllm_server.log" 2>&1 &
SERVER_PID=$!
timed server_start wait_server

# 2. Render + loss masks (one row per assistant turn) + token frequencies (--no-skip-token-freq: off by default,
# and train needs <PREP>/token_freq.pt to build the draft vocabulary).
timed prepare_data "$PY" -m speculators prepare-data --model "$MODEL" --data "$DATA" --output "$PREP" \
    --seq-length "$SEQ" --render-endpoint "$URL" --no-skip-token-freq \
    --num-preprocessing-workers "$(nproc)" ${MAX_SAMPLES:+--max-samples "$MAX_SAMPLES"}
[ -f "$PREP/token_freq.pt" ] || { echo "prepare-data wrote no $PREP/token_freq.pt" >&2; exit 1; }

# 3. Hidden states: one /v1/completions request (prompt = token ids, max_tokens 1) per row;
# files end up as <PREP>/hidden_states/hs_<row>.safetensors. Failed rows are skipped (exit 0), counted below.
timed generate_offline_data "$PY" -m speculators generate-offline-data --model "$MODEL" --endpoint "$URL/v1" \
    --preprocessed-data "$PREP" --output "$PREP/hidden_states" --concurrency "$CONC"
stop_server   # free both cores for training

"$PY" - "$PREP" <<'EOF' | tee "$WORK/stats.txt"
import glob, os, sys
from datasets import load_from_disk
d = load_from_disk(sys.argv[1]).with_format(None)
hs = glob.glob(os.path.join(sys.argv[1], "hidden_states", "hs_*.safetensors"))
print(f"rows\t{len(d)}\ntokens\t{sum(d['seq_len'])}\nloss_tokens\t{sum(map(sum, d['loss_mask']))}")
print(f"hs_files\t{len(hs)}\nhs_GiB\t{sum(map(os.path.getsize, hs)) / 2**30:.2f}")
EOF

[ -z "${STOP_AFTER_EXTRACT:-}" ] || exit 0   # bench_extract_cpu.py compares extraction only

# 4. speculators' own train (TrainConfig.resolve + speculators.train.cli.main) with only our CPU patches. Vocab:
# no d2t/t2d given, so it builds them from <PREP>/token_freq.pt and caches <PREP>/{d2t,t2d}-<K>.npy.
timed train "$PY" -m bench.speculators_train \
    --speculator-type eagle3 --verifier-name-or-path "$MODEL" --target-layer-ids $AUX --num-layers 1 \
    --data-path "$PREP" --hidden-states-path "$PREP/hidden_states" --draft-vocab-size "$VOCAB" \
    --total-seq-len "$TOTAL" --epochs "$EPOCHS" --lr "$LR" --num-workers 0 --on-missing skip \
    --draft-attn-impl sdpa --loss-implementation eager \
    --save-path "$CKPT" --log-dir "$CKPT/logs" "$@"

awk -v a="$T0" -v b="$(now)" 'BEGIN { printf "total\t%.1f\n", b - a }' | tee -a "$TIMES"
FINAL=$(realpath -e "$CKPT/last" 2>/dev/null || { ls -d "$CKPT"/[0-9]* 2>/dev/null || true; } | sort -V | tail -n 1)
[ -n "$FINAL" ] && [ -f "$FINAL/config.json" ] || { echo "no checkpoint under $CKPT" >&2; exit 1; }
echo "final checkpoint (serve with speculative_config {\"method\": \"eagle3\", \"model\": DIR}): $FINAL"
echo "times: $TIMES"
