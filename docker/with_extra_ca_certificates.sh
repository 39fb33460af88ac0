#!/bin/sh
# with_extra_ca_certificates.sh COMMAND [ARG...]: runs COMMAND once the system trust store holds every
# certificate of the build secret extra-ca-certs (a PEM bundle at /run/secrets/extra-ca-certs; absent:
# COMMAND runs as is). Builds behind a TLS-inspecting proxy pass its CA this way; pip, requests and httpx
# read the system bundle /etc/ssl/certs/ca-certificates.crt in the image.
#
# Every RUN that downloads calls this, rather than one RUN adding the certificates once, because BuildKit
# does not key its cache on a secret's content: a cached layer made without the secret would be reused
# when the secret is added. The certificates land in the layer of the first RUN that needs them; later
# calls find them trusted and change nothing.
#
# Only the certificates the store lacks are added (a host's whole ca-certificates.crt repeats the public
# roots), one file each, since update-ca-certificates links a file by its first certificate only.
set -eu
secret=/run/secrets/extra-ca-certs
system=/etc/ssl/certs/ca-certificates.crt
dest=/usr/local/share/ca-certificates
if [ -s "$secret" ]; then
    [ -f "$system" ] || { echo "extra-ca-certs: no $system (install ca-certificates first)" >&2; exit 1; }
    grep -q -- "-----BEGIN CERTIFICATE-----" "$secret" \
        || { echo "extra-ca-certs: the secret holds no PEM certificate" >&2; exit 1; }
    mkdir -p "$dest"
    added=$(awk -v dest="$dest" '
        { sub(/\r$/, "") }
        /-----BEGIN CERTIFICATE-----/ { pem = ""; inside = 1 }
        inside { pem = pem $0 "\n" }
        /-----END CERTIFICATE-----/ {
            inside = 0
            if (FILENAME == ARGV[1]) { known[pem] = 1 }
            else if (!(pem in known)) {
                known[pem] = 1
                do { f = sprintf("%s/extra-ca-%03d.crt", dest, ++n) } while (system("test -e " f) == 0)
                printf "%s", pem > f
                close(f)
                added++
            }
        }
        END { print added + 0 }
    ' "$system" "$secret")
    if [ "$added" -gt 0 ]; then
        update-ca-certificates >/dev/null
        echo "extra-ca-certs: $added certificates added to the system trust store"
    fi
fi
exec "$@"
