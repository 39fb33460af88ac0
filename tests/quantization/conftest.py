"""The tool-made checkpoints' cache, built once per session (jaxllm/testing/quant_checkpoints.py); the tests
that need it skip only when the tools can neither be installed nor found built."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxllm.testing.quant_checkpoints import QuantToolsUnavailable, ensure_quant_checkpoints


@pytest.fixture(scope="session")
def cache() -> Path:
    try:
        return ensure_quant_checkpoints()
    except QuantToolsUnavailable as e:
        pytest.skip(str(e))
