#!/usr/bin/env bash
# Creates the environment (first run only) and serves the embedded SmolLM2-135M-Instruct through the
# OpenAI-compatible API on http://127.0.0.1:8000/v1. Extra arguments go to `jaxllm serve`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec jaxllm serve "$@"
