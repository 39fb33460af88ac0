"""Request generation (ranges, determinism), JSONL datasets and result files."""

import json

import pytest

from benchmarks.workload import (
    RESULT_KEYS,
    length_range,
    load_jsonl,
    make_result,
    random_requests,
    result_path,
    save_result,
)


def test_length_range():
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.5) == (50, 150)
    assert length_range(3, 0.9) == (1, 6)  # floor(0.3) -> at least 1, ceil(5.7)
    with pytest.raises(ValueError, match="range_ratio"):
        length_range(10, 1.0)
    with pytest.raises(ValueError, match="length"):
        length_range(0, 0.1)


def test_random_requests_ranges_and_seed():
    reqs = random_requests(200, 64, 16, vocab_size=1000, range_ratio=0.25, seed=3)
    assert all(48 <= r.input_len <= 80 and len(r.prompt) == r.input_len for r in reqs)
    assert all(12 <= r.output_len <= 20 for r in reqs)
    assert all(0 <= t < 1000 for r in reqs for t in r.prompt)
    assert len({r.input_len for r in reqs}) > 10  # the range is used, not just its ends
    assert reqs == random_requests(200, 64, 16, vocab_size=1000, range_ratio=0.25, seed=3)
    assert reqs != random_requests(200, 64, 16, vocab_size=1000, range_ratio=0.25, seed=4)


def test_fixed_lengths():
    reqs = random_requests(5, 8, 4, vocab_size=50)
    assert [(r.input_len, r.output_len) for r in reqs] == [(8, 4)] * 5


def test_load_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "hello there", "output_len": 7}, {"prompt_token_ids": [1, 2, 3]}, {}]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n")
    reqs = load_jsonl(str(path), default_output_len=5)
    assert reqs[0].prompt == "hello there" and reqs[0].output_len == 7 and reqs[0].input_len == 0
    assert reqs[1].prompt == [1, 2, 3] and reqs[1].input_len == 3 and reqs[1].output_len == 5
    assert len(load_jsonl(str(path), 5, num_prompts=1)) == 1
    path.write_text(json.dumps(rows[2]) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        load_jsonl(str(path), 5)


def test_result_file(tmp_path):
    r = make_result("throughput", "x y/z", None, {"a": 1}, {"output_tok_s": 2.0}, None)
    assert set(RESULT_KEYS) <= set(r) and r["model"] == "embedded"
    name = result_path("x y/z").name
    assert name.endswith("-x_y_z.json") and name[:4].isdigit()
    out = save_result(r, str(tmp_path / "sub" / "r.json"))
    assert json.loads(out.read_text())["results"] == {"output_tok_s": 2.0}
