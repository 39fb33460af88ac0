#!/usr/bin/env bash
# One call on an H200: time from `jaxllm serve` to /health 200, cold (an empty compilation cache) and then
# warm (PASSES-1 restarts on that cache), at the Llama-3.1-8B shape (random bf16 weights) with a word-level
# tokenizer of its vocabulary (what h200_serve_run.sh serves). MAX_SEQS / MAX_TOKENS set --max-num-seqs /
# --max-num-batched-tokens (unset: the server's defaults). Carry .whl (starlette, uvicorn, transformers: benchmarks/README). Results under $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
PY=python3
source benchmarks/install_carried_wheels.sh
install_carried_wheels || exit 1
export PYTHONUNBUFFERED=1
TOK=/tmp/jaxllm-tokenizer-llama-3.1-8b
python3 -c "from benchmarks.server_process import write_synthetic_tokenizer as w; w('$TOK', 128256, 128000, 128009)"
SERVER="python3 -m jaxllm.server.cli serve llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 1024"
SERVER+="${MAX_SEQS:+ --max-num-seqs $MAX_SEQS}${MAX_TOKENS:+ --max-num-batched-tokens $MAX_TOKENS}"
SERVER+=" --tokenizer $TOK --uvicorn-log-level warning"
timeout "${STARTUP_TIMEOUT:-300}" python3 benchmarks/startup.py --mode server --server-command "$SERVER" \
  --passes "${PASSES:-3}" --log-dir "$OUT" --target-warm-s 30 --timeout 240 --name startup-server-llama8b \
  --output-json "$OUT/startup-server-llama8b.json" 2>&1 | grep -v "Warning\|warn" | tail -12
