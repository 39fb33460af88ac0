#!/usr/bin/env bash
# Creates the environment (first run only), installs the test extra (pytest and pytest-xdist, the OpenAI client, and torch
# with transformers' models as the reference the tests compare against) and runs the whole CPU test suite.
# The Debian programs the deployment tests run for real come from scripts/test_services.sh. Extra
# arguments go to pytest.
set -euo pipefail
JAXLLM_INSTALL_EXTRAS="test"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
bash scripts/test_services.sh
# Two workers (JAXLLM_TEST_WORKERS), each taking whole test files (module fixtures such as a served engine
# are built once): most tests wait on XLA's single-threaded CPU compiler, so two overlap on two cores. Each
# worker holds several engines at a time (a few GB): more workers need the memory for them. The 25 slowest
# tests are listed at the end: the suite should stay well under 30 minutes on two cores.
python -m pytest -q -p no:cacheprovider -n "${JAXLLM_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@" tests
