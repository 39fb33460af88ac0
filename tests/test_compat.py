"""jaxllm/compat.py is the only door to private APIs, and each of its doors still opens.

The static half walks every module of jaxllm/: outside compat.py nothing imports a private name (`_x`)
from another jaxllm package or from any outside library, imports a private module (`jax._src`), reads a
private attribute of something it does not define (`threading._register_atexit`, `fn._cache_size`), or
names one in a string (`getattr(x, "_tokenizer")`, `"_decode" in vars(cls)`). The other half calls each
compat function against the installed jax, flax, transformers and Python and checks what it returns on a
real object, so an upgrade that moves one of these private names fails here, by name.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from tests.test_import_graph import module_name, python_files

REPO = Path(__file__).resolve().parents[1]
COMPAT = "jaxllm/compat.py"
STRING_ACCESS = ("getattr", "hasattr", "setattr", "delattr")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def package_of(module: str) -> str:
    """jaxllm.runner.sampler -> jaxllm.runner; jaxllm.config -> jaxllm.config; jax._src.x -> jax."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "jaxllm" else parts[0]


def defined_private_names(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Per package: the private names its own code defines (functions, classes, assigned names and
    attributes, `self._x = ...` included), which its modules may read on each other's objects."""
    names: dict[str, set[str]] = defaultdict(set)
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                found = [node.name]
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found = [
                    e.id if isinstance(e, ast.Name) else e.attr
                    for t in targets
                    for e in ast.walk(t)
                    if isinstance(e, ast.Name | ast.Attribute)
                ]
            else:
                continue
            names[package_of(module)].update(n for n in found if is_private(n))
    return names


def private_uses(root: Path) -> list[str]:
    """`file:line: what` for every private API use outside compat.py (see the module docstring)."""
    files = {p.relative_to(root).as_posix(): p for p in python_files(root, "jaxllm")}
    trees = {module_name(Path(rel)): ast.parse(p.read_text(), filename=str(p)) for rel, p in files.items()}
    own = defined_private_names(trees)
    found = []
    for rel in files:
        if rel == COMPAT:
            continue
        module = module_name(Path(rel))
        package = package_of(module)
        dotted = module if rel.endswith("__init__.py") else module.rpartition(".")[0]
        imported_from_elsewhere: set[str] = set()  # local names bound to another package's objects
        for node in ast.walk(trees[module]):
            where = (rel, getattr(node, "lineno", 0))
            if isinstance(node, ast.Import):
                for a in node.names:
                    if any(is_private(p) for p in a.name.split(".")):
                        found.append((*where, f"import {a.name} (a private module)"))
                    if package_of(a.name) != package:
                        imported_from_elsewhere.add(a.asname or a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = dotted.split(".")[: len(dotted.split(".")) - (node.level - 1)]
                    source = ".".join([*base, source] if source else base)
                if package_of(source) == package:
                    continue
                if any(is_private(p) for p in source.split(".")):
                    found.append((*where, f"from {source} import ... (a private module)"))
                for a in node.names:
                    if is_private(a.name):
                        found.append((*where, f"from {source} import {a.name}"))
                    imported_from_elsewhere.add(a.asname or a.name)
        for node in ast.walk(trees[module]):
            where = (rel, getattr(node, "lineno", 0))
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if owner in ("self", "cls"):
                    continue
                if owner in imported_from_elsewhere or node.attr not in own[package]:
                    found.append((*where, ast.unparse(node)))
            elif (
                isinstance(node, ast.Call) and ast.unparse(node.func) in STRING_ACCESS and len(node.args) >= 2
            ):
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and is_private(name.value):
                    if name.value not in own[package]:
                        found.append((*where, ast.unparse(node)))
            elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant):
                name, right = node.left.value, ast.unparse(node.comparators[0])
                if isinstance(name, str) and is_private(name) and ("vars(" in right or "__dict__" in right):
                    found.append((*where, ast.unparse(node)))
    return [f"{rel}:{line}: {what}" for rel, line, what in sorted(found)]


def test_no_private_api_is_used_outside_compat():
    found = private_uses(REPO)
    if found:
        pytest.fail(
            "private names used across a package boundary (reach them through jaxllm/compat.py):\n  "
            + "\n  ".join(found),
            pytrace=False,
        )


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    files = {
        "jaxllm/__init__.py": "",
        "jaxllm/compat.py": "from jax._src.distributed import global_state\nimport threading\nthreading._x\n",
        "jaxllm/loader/__init__.py": "",
        "jaxllm/loader/loader.py": "def _source_kind(spec):\n    return spec\n",
        "jaxllm/loader/peek.py": "from jaxllm.loader.loader import _source_kind\nfrom .loader import _source_kind\n",
        "jaxllm/parallel/arch_peek.py": """
            import threading
            import jax._src.distributed
            from jax._src import xla_bridge
            from jaxllm.loader.loader import _source_kind
            from flax.linen import module as linen_module

            class Plan:
                def __init__(self):
                    self._mesh = None

            def peek(fn, tok, plan, other):
                threading._register_atexit(print)
                size = fn._cache_size()
                rust = getattr(tok, "_tokenizer", None)
                overridden = "_decode" in vars(type(tok))
                stack = linen_module._global_interceptor_stack
                return plan._mesh, other._mesh, getattr(other, "_mesh"), getattr(other, "_secret")
            """,
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    assert private_uses(tmp_path) == [
        "jaxllm/parallel/arch_peek.py:3: import jax._src.distributed (a private module)",
        "jaxllm/parallel/arch_peek.py:4: from jax._src import ... (a private module)",
        "jaxllm/parallel/arch_peek.py:5: from jaxllm.loader.loader import _source_kind",
        "jaxllm/parallel/arch_peek.py:13: threading._register_atexit",
        "jaxllm/parallel/arch_peek.py:14: fn._cache_size",
        "jaxllm/parallel/arch_peek.py:15: getattr(tok, '_tokenizer', None)",
        "jaxllm/parallel/arch_peek.py:16: '_decode' in vars(type(tok))",
        "jaxllm/parallel/arch_peek.py:17: linen_module._global_interceptor_stack",
        "jaxllm/parallel/arch_peek.py:18: getattr(other, '_secret')",
    ]


# ---- each compat function on the installed versions ----------------------------------------------------------
def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout,
    )  # fmt: skip


def test_jit_cache_size_counts_compiled_shapes():
    import jax
    import jax.numpy as jnp

    from jaxllm.compat import jit_cache_size

    f = jax.jit(lambda x: x * 2)
    assert jit_cache_size(f) == 0
    f(jnp.ones(3))
    assert jit_cache_size(f) == 1
    f(jnp.ones(4))
    assert jit_cache_size(f) == 2
    f(jnp.zeros(3))  # a shape seen before: no new program
    assert jit_cache_size(f) == 2


# The worker blocks until the hook sets `release` (or 2 s pass). concurrent.futures joins its workers at
# interpreter exit, so a hook that runs before that join releases the worker at once; one that runs after
# it (plain atexit) finds the worker already timed out.
EXIT_ORDER = """
import sys, threading
from concurrent.futures import ThreadPoolExecutor
from jaxllm.compat import register_atexit_before_thread_pools

release = threading.Event()
pool = ThreadPoolExecutor(1)
pool.submit(lambda: print("worker released" if release.wait(2) else "worker timed out", flush=True))

def hook():
    print("hook", flush=True)
    release.set()

if sys.argv[1] == "compat":
    register_atexit_before_thread_pools(hook)
else:
    import atexit
    atexit.register(hook)
"""


@pytest.mark.parametrize(
    "how, order",
    [("compat", ["hook", "worker released"]), ("atexit", ["worker timed out", "hook"])],
)
def test_exit_hook_runs_before_the_thread_pools_join(how, order):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-c", EXIT_ORDER, how], capture_output=True, text=True, env=env, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == order, res.stdout


def test_distributed_client_is_none_without_jax_distributed():
    from jaxllm.compat import distributed_client

    assert distributed_client() is None


def test_distributed_client_is_the_coordinators_key_value_store():
    """After jax.distributed.initialize (one process, its own coordinator), the client is the store the
    multi-host follower publishes steps through (jaxllm/parallel/follower.py)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = run_python(f"""
        import jax
        from jaxllm.compat import distributed_client
        assert distributed_client() is None
        jax.distributed.initialize(coordinator_address="127.0.0.1:{port}", num_processes=1, process_id=0)
        client = distributed_client()
        client.key_value_set_bytes("jaxllm-compat", b"step 7")
        print(client.blocking_key_value_get_bytes("jaxllm-compat", 5000).decode())
        client.key_value_delete("jaxllm-compat")
        jax.distributed.shutdown()
        """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "step 7"


def test_jax_backend_errors_say_why_a_backend_did_not_start():
    """With JAX_PLATFORMS unset, JAX tries every backend it knows and keeps why one failed: here the TPU's,
    whose library this machine lacks (on a GPU machine, a CUDA plugin that did not start is told the same
    way; jaxllm doctor quotes it)."""
    res = run_python("""
        import json, os
        os.environ.pop("JAX_PLATFORMS", None)
        import jax
        from jaxllm.compat import jax_backend_errors
        assert jax_backend_errors() == {}  # nothing tried yet
        jax.devices()
        print(json.dumps(jax_backend_errors()))
        """)
    assert res.returncode == 0, res.stderr
    errors = json.loads(res.stdout)
    assert "libtpu" in errors["tpu"], errors


def test_flax_interceptors_active_only_inside_intercept_methods():
    import flax.linen as nn

    from jaxllm.compat import flax_interceptors_active

    assert flax_interceptors_active() is False
    with nn.intercept_methods(lambda f, args, kwargs, context: f(*args, **kwargs)):
        assert flax_interceptors_active() is True
        with nn.intercept_methods(lambda f, args, kwargs, context: f(*args, **kwargs)):
            assert flax_interceptors_active() is True
        assert flax_interceptors_active() is True
    assert flax_interceptors_active() is False


@pytest.fixture(scope="module")
def fast_tokenizer(tmp_path_factory):
    """A word-level tokenizer saved as an HF folder and loaded the way jaxllm loads tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxllm.tokenizer import load_tokenizer

    words = ["<unk>", "<eos>", "the", "capital", "of", "France", "is", "Paris"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    folder = str(tmp_path_factory.mktemp("tokenizer"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(
        folder
    )
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        assert json.load(f)["tokenizer_class"] in ("PreTrainedTokenizerFast", "TokenizersBackend")
    return load_tokenizer(folder)


def test_rust_tokenizer_is_the_fast_tokenizers_own(fast_tokenizer):
    from tokenizers import Tokenizer

    from jaxllm.compat import rust_tokenizer

    rust = rust_tokenizer(fast_tokenizer)
    assert isinstance(rust, Tokenizer)
    text = "the capital of France is Paris"
    assert (
        rust.encode(text).ids == fast_tokenizer.encode(text, add_special_tokens=False) == [2, 3, 4, 5, 6, 7]
    )
    assert rust_tokenizer(object()) is None


def test_rust_decoder_only_where_decode_is_the_rust_tokenizers(fast_tokenizer):
    from transformers import PreTrainedTokenizerFast

    from jaxllm.compat import rust_decoder, rust_tokenizer

    rust = rust_decoder(fast_tokenizer)
    assert rust is rust_tokenizer(fast_tokenizer)
    ids = [2, 3, 4, 5, 1, 6, 7]
    for skip in (True, False):
        expected = fast_tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert rust.decode(ids, skip_special_tokens=skip) == expected
    assert rust.decode(ids, skip_special_tokens=True) == "the capital of France is Paris"

    class Shouting(type(fast_tokenizer)):  # its own decoding: the Rust tokenizer would bypass it
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    loud = Shouting(tokenizer_object=rust, eos_token="<eos>", unk_token="<unk>")
    assert loud.decode([2, 3]) == "THE CAPITAL"
    assert rust_decoder(loud) is None
    assert rust_decoder(PreTrainedTokenizerFast(tokenizer_object=rust)) is not None

    class DecodeOnly:
        def decode(self, ids, **kwargs):
            return fast_tokenizer.decode(ids, **kwargs)

    assert rust_decoder(DecodeOnly()) is None


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize(
    "name, stages", [("probe_loopstages3", 3), ("probe_loopstages1", None), ("probe", None)]
)
def test_named_triton_loops_carry_their_stages(name, stages, monkeypatch):
    """A Pallas Triton kernel named *_loopstages{n} (n > 1) has tt.num_stages = n on its loops once the
    hook is in; other kernels' loops carry nothing."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax._src.pallas.triton import pallas_call_registration as registration
    from jax.experimental import pallas as pl

    from jaxllm.compat import pipeline_named_triton_loops
    from tests.kernels.triton_sm90 import lower_for_h100, triton_modules

    pipeline_named_triton_loops()
    wrapper = registration.lowering.lower_jaxpr_to_triton_module
    pipeline_named_triton_loops()  # idempotent: the same one wrapper
    assert registration.lowering.lower_jaxpr_to_triton_module is wrapper and wrapper.jaxllm_loop_stages

    def kernel(x_ref, o_ref):
        o_ref[...] = lax.fori_loop(
            0, 4, lambda i, acc: acc + x_ref[pl.ds(i * 16, 16)], jnp.zeros(16, jnp.float32)
        )

    def call(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), name=name)(x)

    texts = triton_modules(
        lambda: lower_for_h100(call, jax.ShapeDtypeStruct((64,), jnp.float32)), monkeypatch
    )
    assert len(texts) == 1 and "scf.for" in texts[0]
    assert ("tt.num_stages = 3" in texts[0]) == (stages == 3)
