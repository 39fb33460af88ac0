"""No throughput from a run whose requests did not all finish; the offline benchmark's prefix-cache
workload, its bound on the card it names, and its ratios to the peer (the embedded model on the CPU)."""

import json

import pytest

from benchmarks import throughput
from benchmarks.finished import IncompleteRun, exit_on_incomplete, require_all_finished
from benchmarks.roofline import prefill_flops, shape_for_model

SHARED = ["--workload", "shared-prefix", "--prefix-len", "64", "--input-len", "8", "--output-len", "3"]


def test_require_all_finished_counts_them(capsys):
    require_all_finished("x", 4, 4)
    with pytest.raises(IncompleteRun, match="x: 0 of 128 requests finished") as e:
        require_all_finished("x", 0, 128, ["boom", "boom", "", "bang"])
    assert (e.value.finished, e.value.total, e.value.errors) == (0, 128, ["boom", "bang"])
    with pytest.raises(IncompleteRun, match="0 of 0"):
        require_all_finished("x", 0, 0)

    def main():
        raise IncompleteRun("the peer", 3, 8)

    with pytest.raises(SystemExit) as stop:
        exit_on_incomplete(main)
    assert stop.value.code == 1
    assert "error: the peer: 3 of 8 requests finished; no throughput" in capsys.readouterr().err


def test_peer_ratios_beside_each_figure(capsys):
    res = {"requests_per_s": 3.0, "output_tok_s": 300.0, "total_tok_s": 900.0}
    peer = {"peer": "p", "requests_per_s": 1.5, "output_tok_s": 100.0, "total_tok_s": 1000.0}
    ratios = throughput.peer_ratios(res, peer)
    assert ratios == {"requests_per_s": 2.0, "output_tok_s": 3.0, "total_tok_s": 0.9}
    assert throughput.peer_ratios(res, {"peer": "p", "error": "x"}) is None
    assert throughput.peer_ratios(res, None) is None


def test_shared_prefix_run_its_hits_and_bound(tmp_path, capsys):
    """Four requests after the untimed primer: each finds the 64-token system prompt (4 blocks of 16) in
    the prefix cache, and the H100's bound counts only the 8 tokens of each that are computed."""
    out = tmp_path / "r.json"
    result = throughput.main([*SHARED, "--num-prompts", "4", "--hardware", "h100", "--output-json", str(out)])
    r = result["results"]
    assert (r["num_requests"], r["input_tokens"], r["output_tokens"]) == (4, 4 * 72, 4 * 3)
    assert r["prefix_cache"] == {"queried_tokens": 4 * 72, "hit_tokens": 4 * 64, "hit_rate": 64 / 72}
    assert r["workload"] == "shared-prefix 64+8->3" and r["vs_peer"] is None
    roof = result["roofline"]
    assert roof["hardware"] == "H100" and result["device"] == "cpu"
    shape = shape_for_model(None, "float32")
    assert roof["prefill_flops"] == pytest.approx(4 * prefill_flops(shape, 72, cached_len=64))
    saved = json.loads(out.read_text())
    assert saved["results"]["output_tok_s"] == pytest.approx(r["output_tok_s"])
    text = capsys.readouterr().out
    assert "prefix cache hits 88.9% of prompt tokens" in text and "roofline (H100)" in text


def test_no_figures_when_a_request_did_not_finish(tmp_path, monkeypatch, capsys):
    """One output cut short (as an engine that dropped a request): the run fails, counting them, and no
    throughput is printed or saved. On the CPU, without --hardware, no bound is quoted either."""
    from jaxllm import LLM

    real = LLM.generate

    def lose_one(self, *args, **kwargs):
        outs = real(self, *args, **kwargs)
        if len(outs) == 3:
            outs[1].outputs[0].token_ids = outs[1].outputs[0].token_ids[:1]
        return outs

    monkeypatch.setattr(LLM, "generate", lose_one)
    out = tmp_path / "r.json"
    with pytest.raises(IncompleteRun, match="jaxllm: 2 of 3 requests finished") as e:
        throughput.main(
            ["--num-prompts", "3", "--input-len", "8", "--output-len", "3", "--output-json", str(out)]
        )
    assert "request 1" in str(e.value)
    assert not out.exists() and "tok/s" not in capsys.readouterr().out
