import pytest

from jaxllm.testing.tiny_models import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def jax_cache_dir(tmp_path_factory):
    # One persistent compilation cache for the whole test session: engines built with the same shapes
    # reuse each other's executables instead of compiling again.
    return str(tmp_path_factory.mktemp("xla_cache"))
