"""jaxllm.core must stay host-only: importing it must not pull in jax."""

import subprocess
import sys


def test_core_does_not_import_jax():
    code = (
        "import sys, jaxllm.core.scheduler, jaxllm.core.kv_cache_manager, jaxllm.core.block_pool, "
        "jaxllm.core.memory_report; print('jax' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"
