"""Kernel tests run in Pallas interpret mode on the CPU by default; `--gpu` (or JAXLLM_KERNEL_GPU=1)
runs the same tests compiled on the GPU."""

from __future__ import annotations

import os

import pytest

from tests.kernels import own_process


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", default=False, help="run kernel tests compiled on the GPU")


def _gpu_requested(config) -> bool:
    return bool(config.getoption("--gpu", default=False)) or os.environ.get("JAXLLM_KERNEL_GPU") == "1"


@pytest.fixture(scope="session")
def on_gpu(request) -> bool:
    flag = _gpu_requested(request.config)
    if flag:
        import jax

        if jax.default_backend() != "gpu":
            pytest.skip("--gpu given but JAX sees no GPU")
    return bool(flag)


@pytest.fixture(scope="session")
def interpret(on_gpu) -> bool:
    return not on_gpu


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Tests marked own_process run in a child process with a time limit on the CPU (own_process.py)."""
    if pyfuncitem.get_closest_marker("own_process") is None or own_process.in_child():
        return None
    if _gpu_requested(pyfuncitem.config):
        return None  # compiled on the GPU: no interpreter threads
    own_process.run_in_own_process(pyfuncitem)
    return True
