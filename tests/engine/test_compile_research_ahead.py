"""compile_research_ahead: each bucket's model step with research is traced before ready and compiled in
the background, capturing up to 32 rows and (above 32 tokens) every row; research requests whose slots fit
the floors then run those executables (no research step goes through jit, also where a prompt chunk
captures more than 32 rows) and give the captures and tokens of the same requests compiled through jit."""

from __future__ import annotations

import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.research_params import ResearchParams, Scale, Steer
from jaxllm.runner.research_batch import research_dims, smallest_research_inputs


def _llm(folder, cache, research_ahead: bool):
    return LLM(
        folder,
        dtype="float32",
        max_model_len=128,
        compilation_cache_dir=cache,
        compile_ahead=False,  # plain steps through jit: only the research variants are compiled ahead
        compile_research_ahead=research_ahead,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )


def _research_run(llm):
    """Plain, capturing, steering and ablating requests in one batch, prompts split over chunks; one
    captures every position of a 70-token prompt (more than 32 rows in a chunk: the R = T variant)."""
    rng = np.random.default_rng(5)
    hidden = llm.llm_engine.runner.hidden_size
    vec = rng.standard_normal(hidden).astype(np.float32)
    prompts = [rng.integers(3, 300, int(n)).tolist() for n in (5, 70, 17, 20)]
    research = [
        None,
        ResearchParams(capture=["residual.0", "mlp_out.1", "final_norm"], capture_positions="all"),
        ResearchParams(steer=[Steer("residual.0", vec, 2.0)]),
        ResearchParams(
            capture=["attn_out.1"], scale=[Scale("mlp_out.0", 0.0), Scale("attn_out.1", 0.5, head=1)]
        ),
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, research=r) for r in research]
    outs = llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    caps = [o.outputs[0].captures for o in outs]
    return tokens, caps


def test_research_steps_run_the_executables_compiled_ahead(tiny_llama_dir, jax_cache_dir):
    jit_tokens, jit_caps = _research_run(_llm(tiny_llama_dir, jax_cache_dir, research_ahead=False))
    llm = _llm(tiny_llama_dir, jax_cache_dir, research_ahead=True)
    runner = llm.llm_engine.runner
    runner.wait_for_background_compiles()
    shapes = runner.plan.all_shapes()
    floors = research_dims(smallest_research_inputs(8, runner.hidden_size))
    assert floors == (32, 8, 8, 8, 8, 8, 0)
    variants = {(s, (32, *floors[1:6], residual)) for s in shapes for residual in (0, 1)}
    every_row = {(s, (s[0], *floors[1:6], residual)) for s in shapes if s[0] > 32 for residual in (0, 1)}
    assert every_row  # the 64-token bucket
    assert set(runner.compiler.ahead_research) == variants | every_row
    compiler = runner.compiler
    step_jit = compiler.step_jit
    jitted_research = []

    def no_research_through_jit(shape):
        step = step_jit(shape)

        def call(*args, **kwargs):
            if len(args) > 4:  # the research inputs: this step should have run an executable compiled ahead
                jitted_research.append(shape)
            return step(*args, **kwargs)

        return call

    compiler.step_jit = no_research_through_jit
    ran = []
    for key, exe in list(compiler.ahead_research.items()):
        compiler.ahead_research[key] = lambda *a, exe=exe, key=key: ran.append(key) or exe(*a)
    tokens, caps = _research_run(llm)
    assert ran and not jitted_research, (ran, jitted_research)
    assert tokens == jit_tokens
    assert [c is None for c in caps] == [True, False, True, False]
    for got, want in zip(caps, jit_caps):
        if want is None:
            continue
        assert got.positions == want.positions and sorted(got.arrays) == sorted(want.arrays)
        for site, a in want.arrays.items():
            np.testing.assert_allclose(got.arrays[site], a, rtol=1e-5, atol=1e-5)
    # "all": the prompt's positions and each sampled token fed back (not the last).
    assert caps[1].arrays["final_norm"].shape == (70 + 6 - 1, runner.hidden_size)
    assert {k[1][0] for k in ran} >= {32, 64}  # both row sizes ran
    assert caps[3].arrays["attn_out.1"].shape == (20 + 6 - 1, runner.hidden_size)
