"""Pallas Triton kernels checked for an H100 without one: the op lowered for the "cuda" platform with an
abstract H100 device (the Triton lowering asks for a compute capability), and the Triton IR it emits
compiled by the `triton` package for sm_90 (Triton's passes accept it, its dots run on mma, it fits in
shared memory, and ptxas keeps every value in registers)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import jax
import pytest

H100 = dict(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
SHARED_MEMORY_BYTES = 227 * 1024  # per block on sm_90


def lower_for_h100(fn: Callable, *args: jax.ShapeDtypeStruct) -> str:
    """`fn(*args)` under a fresh jit, lowered for the "cuda" platform with an abstract H100: the HLO text
    (a fresh jit each call, so the Triton lowering runs again rather than coming from a cache)."""
    dev = jax.sharding.AbstractDevice(**H100)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(lambda *a: fn(*a)).trace(*args)
        return traced.lower(lowering_platforms=("cuda",)).as_text()


def triton_modules(lower: Callable[[], object], monkeypatch) -> list[str]:
    """The text of every Triton module Pallas emits while `lower()` runs (skips where Pallas' Triton
    internals are absent)."""
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
    except ImportError:
        pytest.skip("Pallas Triton internals not available")
    modules = []
    emit = registration.lowering.lower_jaxpr_to_triton_module

    def keep_module(*args, **kwargs):
        result = emit(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", keep_module)
    lower()
    return modules


def assert_compiles_for_sm90(
    lower: Callable[[], object],
    launch: dict,
    monkeypatch,
    tmp_path,
    *,
    mma: bool = True,
    modules_emitted: int = 1,
    async_copies: bool | None = None,
) -> None:
    """The first of the `modules_emitted` Triton modules `lower()` emits, compiled for sm_90 with `launch`'s num_warps and num_stages
    (the kernel's own choice for the case), its dots on mma where `mma`; skips where
    the `triton` package or Pallas' Triton internals are absent (their absence says nothing about the
    kernel). With ptxas at hand, asserts it spills nothing. `async_copies` (unless None): whether its loads
    must have been pipelined as asynchronous copies."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    modules = triton_modules(lower, monkeypatch)
    assert len(modules) == modules_emitted, len(modules)
    ttir = modules[0]
    src = tmp_path / "kernel.ttir"
    src.write_text(ttir)
    compiled = triton.compile(
        str(src),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=launch["num_warps"], num_stages=launch["num_stages"]),
    )
    assert compiled.metadata.shared <= SHARED_MEMORY_BYTES
    assert ("mma" in compiled.asm["ptx"]) == mma
    if async_copies is not None:  # loads pipelined into shared memory (Triton's software pipeliner)
        assert ("async_copy_global_to_local" in compiled.asm["ttgir"]) == async_copies
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    ptxas = str(ptxas) if ptxas.exists() else shutil.which("ptxas")
    if ptxas is None:
        return
    ptx = tmp_path / "kernel.ptx"
    ptx.write_text(compiled.asm["ptx"])
    info = subprocess.run(
        [ptxas, "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(tmp_path / "kernel.cubin")],
        capture_output=True, text=True, check=True,
    ).stderr  # fmt: skip
    assert "0 bytes spill stores" in info, info
