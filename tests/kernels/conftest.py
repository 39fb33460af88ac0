"""Kernel tests run in Pallas interpret mode on the CPU by default; `--gpu` (or JAXLLM_KERNEL_GPU=1)
runs the same tests compiled on the GPU."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", default=False, help="run kernel tests compiled on the GPU")


@pytest.fixture(scope="session")
def on_gpu(request) -> bool:
    flag = request.config.getoption("--gpu", default=False) or os.environ.get("JAXLLM_KERNEL_GPU") == "1"
    if flag:
        import jax

        if jax.default_backend() != "gpu":
            pytest.skip("--gpu given but JAX sees no GPU")
    return bool(flag)


@pytest.fixture(scope="session")
def interpret(on_gpu) -> bool:
    return not on_gpu
