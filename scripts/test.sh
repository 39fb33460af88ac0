#!/usr/bin/env bash
# Creates the environment (first run only) and runs the whole CPU test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
python -m pytest -q -p no:cacheprovider "$@" tests
