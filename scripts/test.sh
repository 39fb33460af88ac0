#!/usr/bin/env bash
# Creates the environment (first run only), installs the test extra (pytest, the OpenAI client, and torch
# with transformers' models as the reference the tests compare against) and runs the whole CPU test suite.
# Extra arguments go to pytest.
set -euo pipefail
JAXLLM_INSTALL_EXTRAS="test"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
python -m pytest -q -p no:cacheprovider "$@" tests
