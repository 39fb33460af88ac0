#!/usr/bin/env bash
# One call on an H200, within DEADLINE_S seconds (default 570): the GPU tests of the attention kernels
# (KERNEL_TESTS, default the Triton, Mosaic and Hopper-routing ones), the engine check of both Pallas
# backends against the reference, then the offline throughput benchmark (1000 x 512 -> 256,
# Llama-3.1-8B shape) under each backend in BACKENDS (default pallas-hopper, then pallas), each part cut
# short when the deadline nears. Results go under $OUT.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 JAXLLM_CACHE_DIR=/tmp/jaxllm-xla
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
DEADLINE_S="${DEADLINE_S:-570}"
SECONDS=0
left() { local l=$((DEADLINE_S - SECONDS)); [ "$l" -gt "$1" ] && echo "$1" || echo "$l"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
timeout "$(left 200)" python3 -m pytest -q -p no:cacheprovider --gpu -m "not full_grid" \
  ${KERNEL_TESTS:-tests/kernels/test_hopper_dispatch.py tests/kernels/test_mosaic_prefill.py tests/kernels/test_triton_attention.py} \
  > "$OUT/kernel-tests.log" 2>&1
echo "kernel tests rc=$? after ${SECONDS}s"; grep -v "^\.*\( *\[.*\]\)\?$\|Warning\|warn" "$OUT/kernel-tests.log" | tail -12
timeout "$(left 150)" python3 benchmarks/gpu_engine_check.py "$OUT/engine-check.json" pallas pallas-hopper \
  > "$OUT/engine-check.log" 2>&1
echo "engine check rc=$? after ${SECONDS}s"; grep "ENGINE GPU CHECK\|Error" "$OUT/engine-check.log" | tail -6
for b in ${BACKENDS:-pallas-hopper pallas}; do
  t="$(left 300)"; [ "$t" -lt 60 ] && { echo "no time left for throughput $b"; continue; }
  timeout "$t" python3 benchmarks/throughput.py --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
    --num-prompts 1000 --input-len 512 --output-len 256 --max-model-len 1024 --max-num-seqs 256 \
    --max-num-batched-tokens 2048 --warmup-prompts 16 --num-gpu-blocks-override 50000 --attention-backend "$b" \
    --name "llama-3.1-8b-1000x512x256-$b" --output-json "$OUT/throughput-llama8b-1000x512x256-$b.json" \
    > "$OUT/throughput-$b.log" 2>&1
  echo "throughput $b rc=$? after ${SECONDS}s"; grep -v "Processed prompts\|Warning\|warn" "$OUT/throughput-$b.log" | tail -14
done
