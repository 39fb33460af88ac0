#!/usr/bin/env bash
# One call on an H200: every kernel test compiled for the GPU, the engine check of both Pallas backends
# against the reference, and profiles of decode, mixed and prefill steps at the Llama-3.1-8B shape under
# both backends (benchmarks/step_profile.py). Results go under $OUT.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 JAXLLM_CACHE_DIR=/tmp/jaxllm-xla
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
SECONDS=0
if [ "${SKIP_KERNEL_TESTS:-0}" != 1 ]; then
  timeout "${KERNEL_TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" --gpu \
    tests/kernels ${KERNEL_TESTS_ARGS:-} > "$OUT/kernel-tests.log" 2>&1
  echo "kernel tests rc=$? after ${SECONDS}s"; grep -v "^\.\|Warning\|warn" "$OUT/kernel-tests.log" | tail -15
fi
if [ "${SKIP_ENGINE_CHECK:-0}" != 1 ]; then
  timeout 240 python3 benchmarks/gpu_engine_check.py "$OUT/engine-check.json" pallas pallas-hopper 2>&1 \
    | grep "ENGINE GPU CHECK\|Error\|error" | tail -6
  echo "engine check done after ${SECONDS}s"
fi
profile() {  # backend, then step_profile's case flags
  local backend="$1"; shift
  timeout "${PROFILE_TIMEOUT:-150}" python3 benchmarks/step_profile.py --model llama-3.1-8b --reps 8 \
    --attention-backend "$backend" --output-json "$OUT/step-profile-llama8b-$backend.json" "$@" 2>&1 \
    | grep -v "Warning\|warn" | tail -8
  echo "profile $backend done after ${SECONDS}s"
}
profile pallas --decode 1x640 --decode 32x640 --decode 256x640 --decode 64x2048 \
  --mixed 248x640+3x600 --mixed 0x640+4x512
profile pallas-hopper --mixed 248x640+3x600 --mixed 0x640+4x512 --mixed 0x640+1x2048
