"""jaxllm.testing.quant_checkpoints without the tools: when a cache counts as current, and which failure
makes the checkpoint tests skip (no network and no cache) rather than fail."""

from __future__ import annotations

import json

import pytest

from jaxllm.testing import quant_checkpoints as qc


def _fake_cache(root, names, recipe_sha256):
    manifest = {"recipe_sha256": recipe_sha256, "checkpoints": {name: {} for name in names}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    for name in names:
        folder = root / "checkpoints" / name
        folder.mkdir(parents=True)
        (folder / "reference.json").write_text("{}")


def test_cache_is_current_only_for_the_current_recipe(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXLLM_QUANT_TOOLS_DIR", str(tmp_path))
    build = qc._build_module()
    _fake_cache(tmp_path, ["base", "ct-fp8-dynamic"], build.recipe_hash())
    assert build.is_complete(tmp_path, ["base", "ct-fp8-dynamic"])
    assert not build.is_complete(tmp_path, ["base", "awq-w4g64-gemm"])
    # A cache that is current is returned without creating the tools' venv.
    assert qc.ensure_quant_checkpoints(["base"]) == tmp_path
    assert not (tmp_path / "venv").exists()
    (tmp_path / "manifest.json").write_text(json.dumps({"recipe_sha256": "0" * 64, "checkpoints": {}}))
    assert not build.is_complete(tmp_path, ["base"])


def test_unknown_name_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXLLM_QUANT_TOOLS_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="ct-fp9"):
        qc.ensure_quant_checkpoints(["ct-fp9"])


@pytest.mark.parametrize("reachable", [False, True])
def test_failed_install_skips_only_without_network(tmp_path, monkeypatch, reachable):
    monkeypatch.setenv("JAXLLM_QUANT_TOOLS_DIR", str(tmp_path))
    monkeypatch.setenv("JAXLLM_QUANT_TOOLS_PYTHON", str(tmp_path / "no-such-python"))
    monkeypatch.setattr(qc, "_index_reachable", lambda: reachable)
    expected = RuntimeError if reachable else qc.QuantToolsUnavailable
    with pytest.raises(expected) as info:
        qc.ensure_quant_checkpoints(["base"])
    assert (type(info.value) is qc.QuantToolsUnavailable) == (not reachable)
    assert not (tmp_path / "venv").exists()
