#!/usr/bin/env bash
# One call on an H200: kernel tests compiled for the GPU, the engine's Pallas-vs-reference check, the
# offline throughput benchmark and decode-only steps against the bandwidth bound, at the Llama-3.1-8B
# shape (random weights). Results go under $OUT. SKIP_ENGINE_CHECK / SKIP_DECODE_STEP / SKIP_KERNEL_TESTS=1
# leave a part out; ATTENTION_BACKEND (pallas, pallas-hopper) picks the attention kernels of the
# throughput and decode-step runs (default: auto). MAX_SEQS / MAX_TOKENS / NUM_GPU_BLOCKS set
# --max-num-seqs / --max-num-batched-tokens / --num-gpu-blocks-override; unset, the engine's defaults hold
# (vLLM's on an H200: 1024 sequences, 16384 tokens per step, the KV cache sized from memory).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 JAXLLM_CACHE_DIR=/tmp/jaxllm-xla
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
SUFFIX="${MAX_SEQS:+-s$MAX_SEQS}${MAX_TOKENS:+-t$MAX_TOKENS}${ATTENTION_BACKEND:+-$ATTENTION_BACKEND}"
if [ "${SKIP_ENGINE_CHECK:-0}" != 1 ]; then
  timeout 200 python3 benchmarks/gpu_engine_check.py "$OUT/engine-check.json" 2>&1 | grep -v Warning | tail -4
fi
[ "${SKIP_THROUGHPUT:-0}" != 1 ] && timeout "${THROUGHPUT_TIMEOUT:-420}" python3 benchmarks/throughput.py --model llama-3.1-8b --load-format dummy \
  --dtype bfloat16 --num-prompts "${NUM_PROMPTS:-1000}" --input-len 512 --output-len 256 --max-model-len 1024 \
  ${MAX_SEQS:+--max-num-seqs $MAX_SEQS} ${MAX_TOKENS:+--max-num-batched-tokens $MAX_TOKENS} --warmup-prompts 16 \
  --attention-backend "${ATTENTION_BACKEND:-auto}" ${NUM_GPU_BLOCKS:+--num-gpu-blocks-override $NUM_GPU_BLOCKS} \
  --name "llama-3.1-8b-1000x512x256$SUFFIX" --output-json "$OUT/throughput-llama8b-1000x512x256$SUFFIX.json" 2>&1 \
  | grep -v "Processed prompts" | tail -25
if [ "${SYNC_COMPARE:-0}" = 1 ]; then  # the same run with one step at a time (no async scheduling)
  timeout "${SYNC_TIMEOUT:-300}" python3 benchmarks/throughput.py --model llama-3.1-8b --load-format dummy \
    --dtype bfloat16 --num-prompts "${NUM_PROMPTS:-1000}" --input-len 512 --output-len 256 --max-model-len 1024 \
    ${MAX_SEQS:+--max-num-seqs $MAX_SEQS} ${MAX_TOKENS:+--max-num-batched-tokens $MAX_TOKENS} --warmup-prompts 16 \
    ${NUM_GPU_BLOCKS:+--num-gpu-blocks-override $NUM_GPU_BLOCKS} --no-async-scheduling --name llama-3.1-8b-1000x512x256-sync \
    --output-json "$OUT/throughput-llama8b-1000x512x256-sync.json" 2>&1 | grep -v "Processed prompts" | tail -8
fi
if [ "${SKIP_DECODE_STEP:-0}" != 1 ]; then
  timeout "${DECODE_STEP_TIMEOUT:-180}" python3 benchmarks/decode_step.py --model llama-3.1-8b --batches 1,32,256 \
    --contexts 640,2048 --attention-backend "${ATTENTION_BACKEND:-auto}" --output-json "$OUT/decode-steps-llama8b.json" 2>&1 | grep -v Warning | tail -12
fi
if [ "${SKIP_KERNEL_TESTS:-0}" != 1 ]; then
  timeout "${KERNEL_TESTS_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/kernels --gpu 2>&1 | tail -4 | tee "$OUT/kernel-tests.log"
fi
