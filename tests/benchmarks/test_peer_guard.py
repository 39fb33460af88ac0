"""A failing or slow peer comes back as an error entry; the benchmark carries on."""

from benchmarks.peer_transformers import run_peer_subprocess


def test_peer_timeout_is_reported():
    out = run_peer_subprocess({"architectures": ["LlamaForCausalLM"]}, [[1, 2]], [2], 0.0, timeout_s=0.01)
    assert out["peer"] == "transformers generate_batch"
    assert "did not finish" in out["error"]
