#!/usr/bin/env bash
# One call on an H200: the OpenAI server at the Llama-3.1-8B shape (random weights, bf16), a concurrency
# sweep of streaming completions (512 -> 256 tokens, ignore_eos), then one restart of the server on the
# now-warm compilation cache (warm startup). The first start is warm too when an earlier call on the same
# machine compiled the same configuration into the same cache dir (h200_engine_run.sh: throughput.py).
#
#   bash benchmarks/h200_serve_run.sh          (carry .whl: starlette, uvicorn and transformers, installed into /tmp/site: README)
#
# MAX_SEQS / MAX_TOKENS set --max-num-seqs / --max-num-batched-tokens (unset: the server's defaults, vLLM's on
# an H200: 1024 / 8192). POISSON_RATE (default 12 requests/s; 0 skips it) adds a last run: Poisson arrivals
# capped at POISSON_CONCURRENCY (32) concurrent requests, POISSON_PROMPTS (240) of them, on a fresh launch
# of the server (warm cache) - the steady state of concurrency 32, where the sweep's levels start every
# client at once and stay in step (their TTFT is bounded by that wave; README).
#
# Under $OUT: <date>-<device>-serve-<tag>-sweep.json (rewritten after every level), <date>-<device>-startup-
# server-<tag>.json (the sweep's launch and the restart), server-sweep.log, server-startup-0-<cold|warm>.log,
# run.log; a markdown table last. Every phase ends by a deadline inside BUDGET_S seconds: a level still
# running at the sweep deadline is cut (marked "cut"), later ones are skipped. The random-weight preset has
# no tokenizer; a word-level one of its vocabulary is written for the server (--synthetic-tokenizer).
# SERVER_FLAGS adds server flags (e.g. "--gil-switch-interval-ms 5" with TAG=llama8b-switch5 for an A/B).
# GPU_UTIL_INTERVAL sets serve.py's nvidia-smi poll period for the sweep (0: off; it costs ~2% at c=1).
# The same path on a CPU, small:
#   PYTHON=.venv/bin/python JAX_PLATFORMS=cpu MODEL=tiny-llama INPUT_LEN=32 OUTPUT_LEN=16 LEVELS=1,4 \
#   PROMPTS=2,8 WARMUP=2 MAX_MODEL_LEN=64 MAX_SEQS=8 MAX_TOKENS=64 DTYPE=float32 CACHE_DIR=/tmp/jx \
#   OUT=/tmp/out bash benchmarks/h200_serve_run.sh
set -uo pipefail
T0=$(date +%s)
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
source benchmarks/install_carried_wheels.sh
MODEL="${MODEL:-llama-3.1-8b}"
if [ "$MODEL" = llama-3.1-8b ]; then TAG="${TAG:-llama8b}"; else TAG="${TAG:-$MODEL}"; fi
CACHE="${CACHE_DIR:-/tmp/jaxllm-xla}"
TOK="${TOKENIZER_DIR:-/tmp/jaxllm-tokenizer-$MODEL}"
INPUT_LEN="${INPUT_LEN:-512}"
OUTPUT_LEN="${OUTPUT_LEN:-256}"
LEVELS="${LEVELS:-1,8,32,64,128}"
PROMPTS="${PROMPTS:-6,24,96,192,384}"
WARMUP="${WARMUP:-16}"
BUDGET="${BUDGET_S:-540}"             # the whole script
WARM_RESERVE="${WARM_RESERVE_S:-200}" # kept for the restart, the Poisson run and the report
read -r -a TARGETS <<<"${TARGETS:-c32:median_tpot_ms<=5.5 c32:median_ttft_ms<=60 c1:output_throughput>=250}"
WARM_TARGET="${WARM_TARGET_S:-30}"
SERVER="$PY -m jaxllm.server.cli serve $MODEL --load-format dummy --dtype ${DTYPE:-bfloat16}"
SERVER+=" --max-model-len ${MAX_MODEL_LEN:-1024}${MAX_SEQS:+ --max-num-seqs $MAX_SEQS}"
SERVER+="${MAX_TOKENS:+ --max-num-batched-tokens $MAX_TOKENS} --tokenizer $TOK --uvicorn-log-level warning"
SERVER+="${NUM_GPU_BLOCKS:+ --num-gpu-blocks-override $NUM_GPU_BLOCKS}${SERVER_FLAGS:+ $SERVER_FLAGS}"

elapsed() { echo "$(($(date +%s) - T0)) s"; }
cache_files() { find "$CACHE" -type f 2>/dev/null | wc -l; }

run() {
  install_carried_wheels || return 1
  export PYTHONUNBUFFERED=1 JAXLLM_CACHE_DIR="$CACHE"
  local dev date serve_json start_json deadline left
  dev=$("$PY" -c 'from benchmarks.workload import device_tag; print(device_tag())')
  date=$(date -u +%F)
  serve_json="$OUT/$date-$dev-serve-$TAG-sweep.json"
  start_json="$OUT/$date-$dev-startup-server-$TAG.json"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv
  echo "server: $SERVER"
  echo "compilation cache $CACHE: $(cache_files) files before the first start"

  # 1. Start the server (timed to /health 200), probe, warm up, sweep; serve.py stops the server.
  deadline=$((T0 + BUDGET - WARM_RESERVE))
  left=$((deadline - $(date +%s)))
  echo "== [$(elapsed)] sweep: concurrency $LEVELS, prompts $PROMPTS, ${INPUT_LEN} -> ${OUTPUT_LEN} tokens, ends in $left s"
  left=$((left > 60 ? left : 60))
  timeout -k 60 $((left + 30)) "$PY" benchmarks/serve.py \
    --launch "$SERVER --port 8000 --compilation-cache-dir $CACHE" --base-url http://127.0.0.1:8000 \
    --launch-timeout $((left - 20)) --server-log "$OUT/server-sweep.log" --synthetic-tokenizer "$TOK" \
    --shape-model "$MODEL" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --sweep-concurrency "$LEVELS" --sweep-num-prompts "$PROMPTS" --warmup-prompts "$WARMUP" \
    --sweep-deadline "$deadline" --target "${TARGETS[@]}" --name "serve-$TAG-sweep" --output-json "$serve_json" \
    ${GPU_UTIL_INTERVAL:+--gpu-util-interval "$GPU_UTIL_INTERVAL"}
  echo "serve.py exit code $?"

  # 2. Restart once on the same cache: time to /health 200 (warm startup).
  left=$((T0 + BUDGET - $(date +%s) - 15))
  echo "== [$(elapsed)] restart on the cache ($(cache_files) files), $left s"
  local earlier=()
  [ -f "$serve_json" ] && earlier=(--earlier-start "$serve_json")
  if [ "$left" -ge 40 ]; then
    timeout -k 30 "$left" "$PY" benchmarks/startup.py --mode server --server-command "$SERVER" --port 8001 \
      --cache-dir "$CACHE" --keep-cache --passes 1 --log-dir "$OUT" --timeout $((left - 10)) "${earlier[@]}" \
      --target-warm-s "$WARM_TARGET" --name "startup-server-$TAG" --output-json "$start_json"
    echo "startup.py exit code $?"
  else
    echo "no time left for the restart"
  fi

  # 3. Poisson arrivals at concurrency <= 32: steady-state TTFT and TPOT.
  left=$((T0 + BUDGET - $(date +%s) - 10))
  local poisson_json="$OUT/$date-$dev-serve-$TAG-poisson.json"
  if [ "${POISSON_RATE:-12}" != 0 ] && [ "$left" -ge 60 ]; then
    echo "== [$(elapsed)] Poisson ${POISSON_RATE:-12} req/s, concurrency <= ${POISSON_CONCURRENCY:-32}, $left s"
    timeout -k 30 "$left" "$PY" benchmarks/serve.py \
      --launch "$SERVER --port 8002 --compilation-cache-dir $CACHE" --base-url http://127.0.0.1:8002 \
      --launch-timeout $((left - 30)) --server-log "$OUT/server-poisson.log" --synthetic-tokenizer "$TOK" \
      --shape-model "$MODEL" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
      --request-rate "${POISSON_RATE:-12}" --max-concurrency "${POISSON_CONCURRENCY:-32}" \
      --num-prompts "${POISSON_PROMPTS:-240}" --warmup-prompts "$WARMUP" --sweep-deadline $((T0 + BUDGET - 5)) \
      --name "serve-$TAG-poisson" --output-json "$poisson_json"
    echo "serve.py (Poisson) exit code $?"
  else
    echo "Poisson run skipped (POISSON_RATE=${POISSON_RATE:-12}, $left s left)"
  fi

  # 4. The table.
  echo "== [$(elapsed)] done"
  local files=()
  for f in "$serve_json" "$start_json" "$poisson_json"; do [ -f "$f" ] && files+=("$f"); done
  [ ${#files[@]} -gt 0 ] && "$PY" benchmarks/serve.py --report "${files[@]}"
}

run 2>&1 | tee "$OUT/run.log"
