#!/usr/bin/env bash
# Creates the environment (first run only), installs the test extra (pytest, the OpenAI client, and torch
# with transformers' models as the reference the tests compare against) and runs the whole CPU test suite.
# The Debian programs the deployment tests run for real come from scripts/test_services.sh. Extra
# arguments go to pytest.
set -euo pipefail
JAXLLM_INSTALL_EXTRAS="test"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
bash scripts/test_services.sh
python -m pytest -q -p no:cacheprovider "$@" tests
