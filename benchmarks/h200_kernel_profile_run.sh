#!/usr/bin/env bash
# One call on an H200: the kernel tests compiled for the GPU (KERNEL_TESTS_MARK, default "not full_grid":
# the default grid plus the GPU-only tests), the engine check of both Pallas backends against the
# reference, and profiles of decode, mixed and prefill steps at the Llama-3.1-8B shape
# (benchmarks/step_profile.py) under each backend in PROFILE_BACKENDS. Results go under $OUT.
#   SKIP_KERNEL_TESTS=1 / SKIP_ENGINE_CHECK=1 leave a part out; PROFILE_BACKENDS="" skips the profiles;
#   PROFILE_CASES replaces the cases; CMDBUF_FLAGS (XLA_FLAGS) adds decode steps under those flags;
#   CMDBUF_VARIANTS="name=flags;name=flags" adds one such run per variant (CMDBUF_CASES: their cases).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 JAXLLM_CACHE_DIR=/tmp/jaxllm-xla
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
SECONDS=0
if [ "${SKIP_KERNEL_TESTS:-0}" != 1 ]; then
  timeout "${KERNEL_TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -m "${KERNEL_TESTS_MARK:-not full_grid}" \
    --gpu tests/kernels > "$OUT/kernel-tests.log" 2>&1
  echo "kernel tests rc=$? after ${SECONDS}s"; grep -v "^\.*\( *\[.*\]\)\?$\|Warning\|warn" "$OUT/kernel-tests.log" | tail -15
fi
if [ "${SKIP_ENGINE_CHECK:-0}" != 1 ]; then
  timeout 240 python3 benchmarks/gpu_engine_check.py "$OUT/engine-check.json" pallas pallas-hopper > "$OUT/engine-check.log" 2>&1
  grep "ENGINE GPU CHECK\|Error" "$OUT/engine-check.log" | tail -6; echo "engine check done after ${SECONDS}s"
fi
profile() {  # backend, name, then step_profile's case flags
  local backend="$1" name="$2"; shift 2
  timeout "${PROFILE_TIMEOUT:-150}" python3 benchmarks/step_profile.py --model llama-3.1-8b --reps 8 \
    --attention-backend "$backend" --output-json "$OUT/step-profile-llama8b-$name.json" "$@" > "$OUT/profile-$name.log" 2>&1
  grep -v "Warning\|warn" "$OUT/profile-$name.log" | grep "wall\|Error" | tail -8
  echo "profile $name done after ${SECONDS}s"
}
CASES="${PROFILE_CASES:---decode 1x640 --decode 32x640 --decode 256x640 --mixed 248x640+3x600 --mixed 0x640+4x512 --mixed 0x640+1x2048}"
for b in ${PROFILE_BACKENDS-pallas pallas-hopper}; do
  # shellcheck disable=SC2086
  profile "$b" "$b" $CASES
done
VARIANTS="${CMDBUF_VARIANTS:-}"
[ -n "${CMDBUF_FLAGS:-}" ] && VARIANTS="cmdbuf=$CMDBUF_FLAGS${VARIANTS:+;$VARIANTS}"
IFS=';' read -r -a VARIANT_LIST <<<"$VARIANTS"
for v in "${VARIANT_LIST[@]}"; do  # the same decode steps with other XLA command-buffer settings
  # shellcheck disable=SC2086
  XLA_FLAGS="${v#*=}" profile pallas "pallas-${v%%=*}" ${CMDBUF_CASES:---decode 1x640 --decode 256x640}
done
