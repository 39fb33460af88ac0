"""Speculative decoding against plain decoding, one engine after the other, same requests.

    python -m benchmarks.speculative [--model M] [--num-speculative-tokens 4] [--prompt-lookup-max 4]
        [--prompt-lookup-min 2] [--draft-model D] [--concurrency 1] [--max-tokens 256] [--output-json FILE]

Proposals by prompt lookup (method ngram), or with `--draft-model` from that model (method draft_model:
a smaller model of the same tokenizer; the pair must be real models for the acceptance to mean anything).

Two workloads, each run by a plain engine and then by one with --speculative-config:
  grounded: chat requests that repeat, correct or rewrite a passage given in the prompt (the passages are
            written out below: nothing is downloaded), the input-grounded work prompt lookup is for;
  random:   prompts of random token ids answered with `--max-tokens` sampled tokens (temperature 1,
            seeded; ignore_eos): little to copy, where speculation must switch itself off (target: at
            least 0.95x). Greedy decoding would not do: a small model's greedy answer to noise falls into
            a loop, which prompt lookup predicts well.
Requests go `--concurrency` at a time (1: one stream, the latency-bound case speculation is for). Output
tok/s = output tokens / wall time of the workload; the ratio spec / plain is the figure (target: 1.5x on
grounded at concurrency 1). Greedy and seeded outputs must be the same tokens in both runs (checked and
reported), so the speed-up is never bought with different text. Acceptance comes from the engine's counters.

The proposals' value depends on the model copying its context: a checkpoint with random weights
(--load-format dummy) does not, so a real model is needed (default: the embedded SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import numpy as np

from benchmarks.finished import exit_on_incomplete, require_all_finished
from benchmarks.workload import make_result, save_result

PASSAGES = [
    "The lighthouse stood at the end of a narrow spit of rock, and for ninety years its keepers had climbed "
    "the same one hundred and twelve steps every evening to light the lamp. In winter the spray froze on the "
    "windows of the lantern room, and the keeper would scrape the glass clean with a wooden blade so that "
    "the beam could reach the ships that passed on their way to the northern harbours.",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl, then add the warm water a "
    "little at a time until the dough comes together. Knead it on a floured table for ten minutes, until it "
    "is smooth and springs back when pressed. Leave it to rise in a warm place for an hour, shape it into a "
    "loaf, and bake it in a hot oven for thirty five minutes.",
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
    "members agreed to increase the funding for the public library by ten percent, to repair the roof of "
    "the town hall before the autumn rains, and to postpone the new footbridge over the river until the "
    "engineers have finished their survey of the eastern bank.",
    "def moving_average(values, window):\n    result = []\n    total = 0.0\n    for i, value in "
    "enumerate(values):\n        total += value\n        if i >= window:\n            total -= values[i - "
    "window]\n        if i >= window - 1:\n            result.append(total / window)\n    return result\n",
]
TASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Correct any mistakes in the following text and return the whole text:\n\n{}",
    "Rewrite the following text in the past tense, keeping everything else the same:\n\n{}",
    "Quote the following passage in full, then say in one sentence what it is about:\n\n{}",
]


def grounded_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = TASKS[i % len(TASKS)].format(PASSAGES[(i // len(TASKS)) % len(PASSAGES)])
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer.encode(prompt, add_special_tokens=False))
    return out


def random_prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab_size - 100, length).tolist() for _ in range(n)]


def run_engine(engine_kw: dict, prompts: list[list[int]], params, concurrency: int) -> dict[str, Any]:
    from jaxllm import LLM

    llm = LLM(**engine_kw)
    llm.generate(None, params, prompt_token_ids=prompts[:concurrency], use_tqdm=False)  # warm-up
    before = llm.llm_engine.get_stats()
    outputs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        outputs += llm.generate(None, params, prompt_token_ids=prompts[i : i + concurrency], use_tqdm=False)
    wall = time.perf_counter() - t0
    require_all_finished(
        f"speculative_config={engine_kw.get('speculative_config')}",
        sum(o.finished for o in outputs),
        len(prompts),
    )
    after = llm.llm_engine.get_stats()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    del llm
    gc.collect()
    num_out = sum(len(t) for t in tokens)
    return {
        "tokens": tokens,
        "output_tokens": num_out,
        "wall_s": round(wall, 3),
        "output_tok_s": round(num_out / wall, 2),
        "steps": after.num_steps - before.num_steps,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
    }


def compare(name: str, engine_kw: dict, spec: dict, prompts, params, concurrency: int) -> dict[str, Any]:
    plain = run_engine(engine_kw, prompts, params, concurrency)
    fast = run_engine({**engine_kw, "speculative_config": spec}, prompts, params, concurrency)
    same = sum(a == b for a, b in zip(plain.pop("tokens"), fast.pop("tokens")))
    row = {
        "workload": name,
        "requests": len(prompts),
        "plain": plain,
        "speculative": fast,
        "speedup": round(fast["output_tok_s"] / plain["output_tok_s"], 3),
        "identical_outputs": f"{same}/{len(prompts)}",
    }
    print(
        f"{name}: plain {plain['output_tok_s']:.1f} tok/s ({plain['steps']} steps), speculative "
        f"{fast['output_tok_s']:.1f} tok/s ({fast['steps']} steps, acceptance {fast['acceptance_rate']}): "
        f"{row['speedup']:.2f}x; identical outputs {row['identical_outputs']}"
    )
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--draft-model", default=None, help="propose with this draft model instead of prompt lookup")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=8, help="requests per workload")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--random-prompt-len", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    p.add_argument("--workloads", default="grounded,random")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    from jaxllm import LLM, SamplingParams

    engine_kw = {
        "model": args.model,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": max(8, args.concurrency),
    }
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }
    if args.draft_model is not None:
        spec = {"model": args.draft_model, "num_speculative_tokens": args.num_speculative_tokens}
    probe = LLM(**{**engine_kw, "gpu_memory_utilization": 0.05, "max_num_seqs": 1, "compile_ahead": False})
    tokenizer, vocab = probe.get_tokenizer(), probe.llm_engine.loaded.arch.vocab_size
    device = probe.llm_engine.startup_info.get("device")
    del probe
    gc.collect()
    rows = []
    for name in args.workloads.split(","):
        if name == "grounded":
            prompts = grounded_prompts(tokenizer, args.num_prompts)
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        elif name == "random":
            prompts = random_prompts(vocab, args.num_prompts, args.random_prompt_len, seed=0)
            params = SamplingParams(temperature=1.0, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
        else:
            raise SystemExit(f"--workloads: unknown workload {name!r} (grounded, random)")
        rows.append(compare(name, engine_kw, spec, prompts, params, args.concurrency))
    result = make_result(
        "speculative", f"speculative-c{args.concurrency}", args.model, vars(args), {"workloads": rows}, None,
        device=device, speculative_config=spec,
    )  # fmt: skip
    path = save_result(result, args.output_json)
    print(f"saved {path}")
    return result


if __name__ == "__main__":
    exit_on_incomplete(main)
