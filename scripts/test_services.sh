#!/usr/bin/env bash
# Installs the Debian packages whose real programs the deployment tests run (the Docker daemon, nginx,
# Prometheus, ...), one package name per line in scripts/test-services.txt. Installs only what is
# missing; needs root (CI runs as root). Without root it says which packages are missing and the tests
# that need them fail with the same names.
set -euo pipefail
LIST="$(dirname "${BASH_SOURCE[0]}")/test-services.txt"
mapfile -t packages < <(grep -v '^\s*\(#\|$\)' "$LIST" || true)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "[services] missing Debian packages (install them as root): ${missing[*]}" >&2
    exit 0
fi
echo "[services] apt-get install ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
