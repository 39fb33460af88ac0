"""benchmarks/grammar_engines.py with the engines this environment has (llguidance is jaxllm's own; the
others are reported as not installed): every document token allowed by the mask and accepted, the end
of each document allowing eos, the batched fill equal to single fills, and the result file's figures
consistent with each other."""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks import grammar_engines as ge


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    pytest.importorskip("llguidance")
    out = tmp_path_factory.mktemp("ge") / "r.json"
    args = ["--out", str(out), "--tokenizers", "smollm2", "--repeats", "1", "--walks", "2", "--batch", "4"]
    return ge.main([*args, "--batch-steps", "12", "--no-footprint"]), out


def test_llguidance_masks_allow_every_document_token(result):
    r, out = result
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(r["results"]))
    ll = r["results"]["by_tokenizer"]["smollm2"]["llguidance"]
    cases = ge.constraint_cases()
    assert list(ll["constraints"]) == [name for name, *_ in cases] and ll["unsupported"] == []
    for name, c in ll["constraints"].items():
        assert c["mask_refused_document_token"] == 0 and c["advance_rejected_document_token"] == 0, name
        assert c["eos_allowed_at_end"], name
        assert 0 < c["allowed_at_start"] < 49152 and c["cached_ms"] <= c["cold_ms"] * 10, name
    choice = ll["constraints"]["choice"]
    assert choice["tokens"] == 1  # "neutral" is one token of SmolLM2's
    n_tokens = sum(c["tokens"] for c in ll["constraints"].values())
    assert ll["fill_per_token_first_walk"]["n"] == n_tokens and ll["fill_per_token"]["n"] == n_tokens
    b = ll["batch"]
    assert (b["rows"], b["steps"], b["batched_rows_differing_from_single_fills"]) == (4, 12, 0)


def test_engines_not_installed_are_reported(result):
    r, _ = result
    engines = r["results"]["by_tokenizer"]["smollm2"]
    for name in ("xgrammar", "outlines_core"):
        if importlib.util.find_spec(name) is None:
            assert engines[name] == {"status": "not installed"}
    assert "| smollm2 | llguidance |" in r["results"]["table"]
    with pytest.raises(ValueError, match="unknown engine"):
        ge.main(["--out", "x.json", "--engines", "nope"])


def test_bit_helpers():
    import numpy as np

    row = np.zeros(3, dtype=np.int32)
    row[1] = 1 << 5  # token 37
    row[2] = np.int32(-(2**31))  # token 95: the sign bit
    assert ge.allowed(row, 37) and ge.allowed(row, 95) and not ge.allowed(row, 36)
    assert ge.allowed_count(row, 96) == 2 and ge.allowed_count(row, 90) == 1
