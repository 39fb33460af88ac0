"""benchmarks/gemm_shapes.py on a tiny model: its groups are the layer's projection weights, and the
fused weight's product is the separate products side by side."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp

from benchmarks import gemm_shapes
from benchmarks.workload import arch_for_model
from jaxllm.models.registry import abstract_params, build_model


def test_groups_are_the_layer_weights():
    """The groups' separate widths add up to the model's (fused) weights."""
    arch = arch_for_model("tiny-llama")
    params = abstract_params(build_model(arch), jnp.bfloat16)
    layer = params["layers_0"]
    shapes = {
        "qkv": layer["attn"]["qkv_proj"]["kernel"].shape,
        "o": layer["attn"]["o_proj"]["kernel"].shape,
        "gate_up": layer["mlp"]["gate_up_proj"]["kernel"].shape,
        "down": layer["mlp"]["down_proj"]["kernel"].shape,
    }
    for name, (k, widths) in gemm_shapes.groups(arch).items():
        assert (k, sum(widths)) == shapes[name], name
    assert len(gemm_shapes.groups(arch)["qkv"][1]) == 3


def test_fused_product_is_the_separate_ones_side_by_side():
    xs, ws = gemm_shapes.make_inputs(5, 64, [32, 16, 16], layers=2)
    fused = [[jnp.concatenate(wl, axis=1)] for wl in ws]
    assert gemm_shapes.fused_matches(xs, ws, fused) < 1e-2
    wrong = [[jnp.concatenate(wl[::-1], axis=1)] for wl in ws]  # k|v|q: not the same columns
    assert gemm_shapes.fused_matches(xs, ws, wrong) > 1e-2
    assert jax.tree.leaves(xs)[0].dtype == jnp.bfloat16


def test_report(tmp_path):
    out = tmp_path / "gemm.json"
    gemm_shapes.main(["--model", "tiny-llama", "--tokens", "8", "--layers", "2", "--reps", "2",
                      "--output-json", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["results"]["rows"]
    assert [(r["tokens"], r["group"]) for r in rows] == [(8, g) for g in ("qkv", "o", "gate_up", "down")]
    assert all(r["separate"]["ms"] > 0 for r in rows)
    assert all(("fused" in r) == (r["group"] in ("qkv", "gate_up")) for r in rows)
    assert all(r["fused_max_abs_diff"] < 1e-2 for r in rows if "fused" in r)
