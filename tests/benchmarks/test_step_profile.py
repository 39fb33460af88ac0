"""benchmarks/step_profile.py: the trace reduction (against a hand-built trace) and the mixed step's
packed inputs (against hand-computed pages, positions and slots)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.step_profile import device_kernel_times, device_spans, device_timeline, kind_of, mixed_inputs
from jaxllm.runner.buckets import BucketPlan


def _trace():
    m = lambda pid, name, tid=None: {  # noqa: E731
        "ph": "M", "pid": pid, "name": "thread_name" if tid is not None else "process_name",
        **({"tid": tid} if tid is not None else {}), "args": {"name": name},
    }  # fmt: skip
    x = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "dur": dur}  # noqa: E731
    return {
        "traceEvents": [
            m(1, "/host:CPU"),
            m(1, "python", tid=5),
            m(2, "/device:GPU:0"),
            m(2, "Stream #13(Compute)", tid=7),
            m(2, "XLA Ops", tid=8),
            x(1, 5, "nvjet_gemm_host_side", 999.0),  # host line: not counted
            x(2, 7, "nvjet_hsh_128x256_gemm", 10.0),
            x(2, 7, "nvjet_hsh_128x256_gemm", 12.5),
            x(2, 7, "ragged_paged_attention_decode", 4.0),
            x(2, 7, "loop_multiply_fusion", 1.0),
            x(2, 8, "dot.12", 22.5),  # the same time under its HLO name: not counted again
        ]
    }


def _stamped(start_by_dur: dict[float, float], other: float) -> dict:
    """_trace with each X event started at start_by_dur[its duration] (`other` for the rest)."""
    trace = _trace()
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            e["ts"] = start_by_dur.get(e["dur"], other)
    return trace


def test_device_kernel_times_counts_stream_kernels_only():
    got = device_kernel_times(_trace())
    assert got == {
        "nvjet_hsh_128x256_gemm": (2, 22.5),
        "ragged_paged_attention_decode": (1, 4.0),
        "loop_multiply_fusion": (1, 1.0),
    }
    assert [kind_of(n) for n in got] == ["matmul", "attention", "fusion"]


def test_device_spans_split_steps_at_long_gaps():
    # _trace's stream kernels carry no ts; place them as two steps: [0, 10) [12, 24.5) | [1000, 1004)
    trace = _stamped({10.0: 0.0, 12.5: 12.0, 4.0: 1000.0, 1.0: 1010.0}, other=5.0)
    assert device_spans(trace) == [(24.5, 22.5), (11.0, 5.0)]


def test_device_timeline_unions_overlaps_and_counts_idle_gaps():
    # Kernels (us): [0, 10) and [5, 17.5) overlap (busy 17.5), then idle 482.5 us, [500, 504), idle 1996 us,
    # [2500, 2501). Busy 22.5 us over a 2501 us span; gaps over 0.1 ms: two (2478.5 us), over 1 ms: one.
    trace = _stamped({10.0: 0.0, 12.5: 5.0, 4.0: 500.0, 1.0: 2500.0}, other=0.0)
    got = device_timeline(trace)
    assert got["busy_s"] * 1e6 == pytest.approx(22.5)
    assert got["span_s"] * 1e6 == pytest.approx(2501.0)
    assert got["busy_share"] == pytest.approx(22.5 / 2501.0)
    assert got["gaps_over_0.1ms"]["count"] == 2
    assert got["gaps_over_0.1ms"]["total_s"] * 1e6 == pytest.approx(482.5 + 1996.0)
    assert got["gaps_over_1ms"]["count"] == 1
    assert got["gaps_over_1ms"]["total_s"] * 1e6 == pytest.approx(1996.0)
    assert device_timeline({"traceEvents": []}) is None


def test_mixed_inputs_pack_decodes_then_chunks():
    plan = BucketPlan.build(64, 8, 8, bucket_pages=False)
    runner = SimpleNamespace(block_size=16, num_blocks=10, plan=plan)
    x = mixed_inputs(runner, decodes=2, context=20, prefills=1, chunk=5)
    # Decode i owns pages 1+2i, 2+2i (20 tokens); the chunk owns page 5 (5 tokens).
    assert x.num_tokens == 7 and int(x.num_seqs[0]) == 3
    np.testing.assert_array_equal(x.block_tables[:3, :2], [[1, 2], [3, 4], [5, 0]])
    np.testing.assert_array_equal(x.kv_lens[:3], [20, 20, 5])
    np.testing.assert_array_equal(x.cu_q_lens[:4], [0, 1, 2, 7])
    assert (x.cu_q_lens[4:] == 7).all()
    np.testing.assert_array_equal(x.positions[:7], [19, 19, 0, 1, 2, 3, 4])
    np.testing.assert_array_equal(x.slot_mapping[:7], [2 * 16 + 3, 4 * 16 + 3, 80, 81, 82, 83, 84])
    assert (x.slot_mapping[7:] == -1).all(), "padding rows write nothing"
    np.testing.assert_array_equal(x.logits_indices[:3], [0, 1, 6])


def test_decode_bound_shares():
    from benchmarks.step_profile import decode_bound

    got = decode_bound(0.006, "H100", {"back_to_back_ms": 8.0, "busy_ms": 7.5})
    assert got == {
        "bound_ms": pytest.approx(6.0),
        "bound_hardware": "H100",
        "back_to_back_share_of_bound": pytest.approx(0.75),
        "busy_share_of_bound": pytest.approx(0.8),
    }
    assert "busy_share_of_bound" not in decode_bound(0.006, "H100", {"back_to_back_ms": 8.0})  # CPU
