"""Request generation (ranges, determinism, the shared-prefix and chat workloads), JSONL datasets and
result files."""

import json
import math

import numpy as np
import pytest

from benchmarks.workload import (
    CHAT_CLIP,
    RESULT_KEYS,
    add_workload_args,
    cached_prefix_lens,
    chat_requests,
    device_tag,
    length_range,
    load_jsonl,
    make_result,
    random_requests,
    result_path,
    save_result,
    shared_prefix_requests,
    workload_requests,
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


def test_device_tag_names_the_card():
    assert device_tag("NVIDIA H100 80GB HBM3") == "h100" and device_tag("NVIDIA H200") == "h200"
    assert device_tag("cpu") == "cpu"
    r = make_result("throughput", "n", None, {}, {}, None, device="NVIDIA H100 80GB HBM3")
    assert r["device"] == "NVIDIA H100 80GB HBM3"
    assert "-h100-n.json" in result_path("n", device=r["device"]).name


def test_shared_prefix_requests():
    reqs = shared_prefix_requests(6, prefix_len=40, input_len=5, output_len=3, vocab_size=50_000, seed=1)
    prefix = reqs[0].prompt[:40]
    assert all(r.prompt[:40] == prefix and len(r.prompt) == r.input_len == 45 for r in reqs)
    assert all(r.output_len == 3 for r in reqs)
    assert len({tuple(r.prompt[40:]) for r in reqs}) == 6  # the user parts differ
    assert reqs == shared_prefix_requests(6, 40, 5, 3, 50_000, seed=1)
    assert reqs[0].prompt[:40] != shared_prefix_requests(6, 40, 5, 3, 50_000, seed=2)[0].prompt[:40]
    # Over 50,000 ids no two user parts start alike: a prefix cache supplies exactly the system prompt
    # to every request but the first (40 of each one's 45 tokens).
    cached = cached_prefix_lens([r.prompt for r in reqs])
    assert sorted(cached) == [0] + [40] * 5
    for bad, field in (({"prefix_len": 0}, "prefix_len"), ({"input_len": 0}, "input_len")):
        kw = {"num_prompts": 2, "prefix_len": 4, "input_len": 2, "output_len": 1, "vocab_size": 9, **bad}
        with pytest.raises(ValueError, match=field):
            shared_prefix_requests(**kw)


def test_cached_prefix_lens_is_the_tries_saving():
    """Against brute force: the tokens left to compute are the nodes of the prompts' trie that the
    primers' trie lacks (each distinct prefix computed once), plus one for each prompt that is whole
    already (a repeat, or a prefix of a primer): its last token is computed for its logits."""
    rng = np.random.default_rng(0)

    def draw(stems):
        return stems[int(rng.integers(0, 3))] + rng.integers(0, 3, size=int(rng.integers(1, 5))).tolist()

    def nodes(ps):
        return {tuple(p[:k]) for p in ps for k in range(1, len(p) + 1)}

    for _ in range(100):
        stems = [rng.integers(0, 3, size=int(rng.integers(0, 5))).tolist() for _ in range(3)]
        prompts = [draw(stems) for _ in range(int(rng.integers(1, 8)))]
        primers = [draw(stems) for _ in range(int(rng.integers(0, 3)))]
        got = cached_prefix_lens(prompts, primers)
        assert all(0 <= c < len(p) for c, p in zip(got, prompts, strict=True))
        repeats = len(prompts) - len({tuple(p) for p in prompts})
        in_primers = sum(tuple(p) in nodes(primers) for p in {tuple(p) for p in prompts})
        want = len(nodes(prompts) - nodes(primers)) + repeats + in_primers
        assert sum(len(p) for p in prompts) - sum(got) == want, (prompts, primers)


def test_chat_lengths_follow_the_stated_lognormal():
    reqs = chat_requests(4000, input_median=300, output_median=120, vocab_size=1000, seed=5)
    ins = np.array([r.input_len for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    assert all(len(r.prompt) == r.input_len for r in reqs[:50])
    assert ins.max() <= CHAT_CLIP * 300 and ins.min() >= 1 and outs.max() <= CHAT_CLIP * 120
    # ln(length) ~ Normal(ln(median), sigma): its mean and std (4,000 draws: standard errors 0.016, 0.011)
    assert np.log(ins).mean() == pytest.approx(math.log(300), abs=0.06)
    assert np.log(ins).std() == pytest.approx(1.0, abs=0.05)
    assert np.log(outs).mean() == pytest.approx(math.log(120), abs=0.06)
    assert np.log(outs).std() == pytest.approx(0.8, abs=0.05)
    # 10% of prompts longer than the median x e^(1.2816 sigma) = 3.6x
    assert (ins > 300 * math.exp(1.2816)).mean() == pytest.approx(0.10, abs=0.015)
    assert reqs == chat_requests(4000, 300, 120, 1000, seed=5)
    with pytest.raises(ValueError, match="input_sigma"):
        chat_requests(2, 10, 10, 100, input_sigma=-1.0)


def test_workload_flags():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--input-len", type=int, default=8)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--range-ratio", type=float, default=0.0)
    add_workload_args(p)
    args = p.parse_args(["--workload", "shared-prefix", "--prefix-len", "16"])
    reqs = workload_requests(args, 3, 1000, seed=0)
    assert [r.input_len for r in reqs] == [24] * 3 and reqs[0].prompt[:16] == reqs[2].prompt[:16]
    args = p.parse_args(["--workload", "chat", "--output-sigma", "0"])
    assert {r.output_len for r in workload_requests(args, 20, 1000, seed=0)} == {4}  # sigma 0: the median
    assert workload_requests(p.parse_args([]), 2, 1000, 0) == random_requests(2, 8, 4, 1000)
