#!/usr/bin/env bash
# One call on an H200: the offline throughput benchmark (1000 x 512 -> 256, Llama-3.1-8B shape, random
# weights) under each attention backend in BACKENDS (default: pallas, then pallas-hopper). The first run
# starts with whatever compilation cache the machine holds (cold on a fresh machine): its startup_info
# carries the compile time of every step variant. Results go under $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
for b in ${BACKENDS:-pallas pallas-hopper}; do
  ATTENTION_BACKEND="$b" SKIP_ENGINE_CHECK=1 SKIP_DECODE_STEP=1 SKIP_KERNEL_TESTS=1 \
    THROUGHPUT_TIMEOUT="${THROUGHPUT_TIMEOUT:-260}" bash benchmarks/h200_engine_run.sh
done
