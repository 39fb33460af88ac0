"""Checks every attention kernel's tests share, and the shared test class of the two Mosaic GPU kernels.

Every check compares an op against ref_ragged_paged_attention on a kernel_cases problem (permuted
pages, NaN in unused pages and page tails, padding rows), so a kernel that is wrong fails it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels.metadata import PagedAttentionMetadata
from jaxllm.kernels.reference import ref_ragged_paged_attention
from jaxllm.testing.kernel_cases import Problem, assert_matches_reference, make_problem, rel_err, tolerance


def check_against_reference(op, prob: Problem, *, sm_scale: float, **kw) -> None:
    """op(*prob.args(), **kw) against the reference given the same soft cap / sliding window (and the
    problem's scales where its pages are fp8)."""
    ref_kw = {k: kw[k] for k in ("soft_cap", "sliding_window") if k in kw}
    ref = ref_ragged_paged_attention(*prob.args(), sm_scale=sm_scale, **ref_kw, **prob.scales())
    out = op(*prob.args(), sm_scale=sm_scale, **kw, **prob.scales())
    assert_matches_reference(out, ref, prob, tolerance(prob.q.dtype))


def assert_detects_wrong_answer(op, prob: Problem, **kw) -> None:
    """The check can fail: the op run with a wrong scale must miss the reference by more than the
    tolerance."""
    ref = ref_ragged_paged_attention(*prob.args(), sm_scale=0.125)
    out = op(*prob.args(), sm_scale=0.2, **kw)
    assert rel_err(out[: prob.num_rows], ref[: prob.num_rows]) > tolerance(prob.q.dtype)


def assert_empty_batch_is_zero(op, prob: Problem, **kw) -> None:
    """num_seqs = 0: every row is padding and must come out as zeros."""
    md = dataclasses.replace(prob.md, num_seqs=jnp.asarray([0], jnp.int32))
    out = np.asarray(op(prob.q, prob.k_pages, prob.v_pages, md, sm_scale=0.125, **kw), np.float32)
    assert (out == 0).all()


def with_md(inputs: dict, **fields) -> dict:
    return {**inputs, "md": dataclasses.replace(inputs["md"], **fields)}


# (change of the inputs {q, k_pages, v_pages, md, kwargs...}, what the error names): the contract every op
# checks the same way (metadata.check_inputs).
CONTRACT_VIOLATIONS = [
    (lambda a: {**a, "q": a["q"][:, :3]}, "multiple of num kv heads"),
    (lambda a: {**a, **{n: a[n][..., :32] for n in ("q", "k_pages", "v_pages")}}, "head_dim"),
    (lambda a: {**a, "v_pages": a["v_pages"][:, :-1]}, "k_pages/v_pages"),
    (lambda a: with_md(a, kv_lens=a["md"].kv_lens.astype(jnp.int16)), "kv_lens"),
    (lambda a: with_md(a, cu_q_lens=a["md"].cu_q_lens[:-1]), "cu_q_lens"),
    (lambda a: with_md(a, block_tables=a["md"].block_tables[0]), "block_tables"),
]


def assert_rejects(op, change, match: str, **kw) -> None:
    """op called with `change` applied to a small valid problem raises a ValueError matching `match`."""
    prob = make_problem([1, 2], [5, 9], hq=4, hkv=2, d=64, page_size=16, dtype=jnp.bfloat16)
    inputs = change(dict(q=prob.q, k_pages=prob.k_pages, v_pages=prob.v_pages, md=prob.md, **kw))
    with pytest.raises(ValueError, match=match):
        op(sm_scale=0.125, **inputs)


@dataclasses.dataclass(frozen=True)
class MosaicCase:
    """One problem for a Mosaic kernel. kv_len > q_len: context before the chunk."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    dtype: type = jnp.bfloat16
    page_size: int = 16
    heads: tuple[int, int] = (4, 2)  # (Hq, Hkv)
    d: int = 64
    config: object = None  # the kernel's config dataclass, None: its default
    aligned: bool = False  # prefill: q_tile_aligned

    def __str__(self) -> str:
        name = f"q{'-'.join(map(str, self.q_lens))}-kv{'-'.join(map(str, self.kv_lens))}"
        name += f"-{jnp.dtype(self.dtype).name}-ps{self.page_size}-h{self.heads[0]}x{self.heads[1]}-d{self.d}"
        if self.aligned:
            name += "-aligned"
        if self.config is not None:
            base = type(self.config)()
            changed = [
                f.name
                for f in dataclasses.fields(self.config)
                if getattr(self.config, f.name) != getattr(base, f.name)
            ]
            name += "".join(f"-{f}{getattr(self.config, f)}" for f in changed)
        return name

    def problem(self, seed: int = 0) -> Problem:
        hq, hkv = self.heads
        return make_problem(
            list(self.q_lens), list(self.kv_lens), hq=hq, hkv=hkv, d=self.d, page_size=self.page_size,
            dtype=self.dtype, seed=seed, pad_rows=0 if self.aligned else 3,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LowerCase:
    """Static shapes of a compiled form, lowered for the "cuda" platform on the CPU."""

    t: int  # query rows
    s: int  # sequence slots
    b: int  # block-table width in pages
    heads: tuple[int, int]
    d: int
    page_size: int
    dtype: type = jnp.bfloat16
    config: object = None
    aligned: bool = False

    def __str__(self) -> str:
        return f"t{self.t}-s{self.s}-b{self.b}-h{self.heads[0]}x{self.heads[1]}-d{self.d}-ps{self.page_size}"


class MosaicKernelTests:
    """The tests both Mosaic GPU kernels pass. A subclass names the op, its config class and its cases.

    On the CPU the kernel runs in Mosaic GPU interpret mode, which simulates the warpgroups, the TMA
    copies and the mbarriers (and checks that every barrier phase is observed), with P V taken from
    shared memory (pv_mode "smem": the interpreter models neither register wgmma operands nor run_state
    accumulators). Lowering for the "cuda" platform is checked on the CPU too. `--gpu` runs the cases
    compiled on the GPU in both pv modes, plus the `gpu`-marked tests.
    """

    op = None  # the public op, as a staticmethod
    Config = None  # its config dataclass
    CASES: list[MosaicCase] = []
    LLAMA_CASES: list[MosaicCase] = []  # GPU only: Llama-3.1-8B heads
    RACE_CASES: list[MosaicCase] = []
    LOWER: list[LowerCase] = []
    BAD_INPUTS: list = []  # (change, match) beyond CONTRACT_VIOLATIONS
    BAD_CONFIGS: list[dict] = []
    WRONG_ANSWER = MosaicCase((1, 1), (300, 45), jnp.float16, heads=(2, 1))  # run with a wrong scale

    def pytest_generate_tests(self, metafunc):
        params = {
            "case": self.CASES,
            "lower": self.LOWER,
            "bad": CONTRACT_VIOLATIONS + self.BAD_INPUTS,
            "config_kw": self.BAD_CONFIGS,
        }
        for name, values in params.items():
            if name in metafunc.fixturenames:
                ids = [f"{m}-{i}" for i, (_, m) in enumerate(values)] if name == "bad" else str
                metafunc.parametrize(name, values, ids=ids)

    def op_kwargs(self, case) -> dict:
        """Keyword arguments of the op beyond sm_scale, config and interpret."""
        return {}

    def run(self, case: MosaicCase, interpret, pv_mode=None):
        cfg = case.config
        if pv_mode is not None:
            cfg = dataclasses.replace(cfg or self.Config(), pv_mode=pv_mode)
        prob = case.problem()
        check_against_reference(
            self.op, prob, sm_scale=case.d**-0.5, config=cfg, interpret=interpret, **self.op_kwargs(case)
        )

    @pytest.mark.own_process
    def test_matches_reference(self, case, interpret):
        self.run(case, interpret)

    @pytest.mark.gpu
    def test_smem_pv_matches_reference_on_gpu(self, case, on_gpu):
        """The compiled form of what interpret mode runs (P through shared memory)."""
        if not on_gpu:
            pytest.skip("needs --gpu")
        self.run(case, interpret=False, pv_mode="smem")

    @pytest.mark.gpu
    def test_llama_shapes_on_gpu(self, on_gpu):
        if not on_gpu:
            pytest.skip("needs --gpu")
        for case in self.LLAMA_CASES:
            self.run(case, interpret=False)

    @pytest.mark.own_process
    def test_interpret_finds_no_races(self):
        """The happens-before race detector of interpret mode: barriers order every SMEM access."""
        try:
            from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mgpu_interpret
        except ImportError:  # private module; its absence says nothing about the kernel
            pytest.skip("Mosaic GPU interpret internals not available")
        import jax.experimental.pallas.mosaic_gpu as plgpu

        if jax.default_backend() != "cpu":
            pytest.skip("interpret mode runs on the CPU")
        for case in self.RACE_CASES:
            params = plgpu.InterpretGPUParams(detect_races=True)
            prob = case.problem()
            self.op(
                *prob.args(),
                sm_scale=case.d**-0.5,
                config=case.config,
                interpret=params,
                **self.op_kwargs(case),
            )
            assert not mgpu_interpret.get_races().races_found, str(case)

    @pytest.mark.own_process
    def test_detects_wrong_answer(self, interpret):
        case = self.WRONG_ANSWER
        assert_detects_wrong_answer(self.op, case.problem(), interpret=interpret, **self.op_kwargs(case))

    @pytest.mark.own_process
    def test_empty_batch_is_zero(self, interpret):
        prob = make_problem([1, 2], [5, 9], hq=2, hkv=1, d=64, page_size=16, dtype=jnp.bfloat16)
        assert_empty_batch_is_zero(self.op, prob, interpret=interpret)

    def test_rejects_bad_inputs(self, bad):
        change, match = bad
        assert_rejects(self.op, change, match, interpret=True)

    def test_rejects_bad_config(self, config_kw):
        with pytest.raises(ValueError, match=next(iter(config_kw))):
            self.Config(**config_kw)

    def test_lowers_for_cuda(self, lower: LowerCase):
        """The Pallas -> Mosaic GPU lowering (layouts, TMA tiling, wgmma shapes) runs on the CPU."""
        hq, hkv = lower.heads
        sds, i32 = jax.ShapeDtypeStruct, jnp.int32
        q = sds((lower.t, hq, lower.d), lower.dtype)
        kv = sds((hkv, lower.s * lower.b + 1, lower.page_size, lower.d), lower.dtype)
        md = PagedAttentionMetadata(
            kv_lens=sds((lower.s,), i32),
            block_tables=sds((lower.s, lower.b), i32),
            cu_q_lens=sds((lower.s + 1,), i32),
            num_seqs=sds((1,), i32),
        )
        kw = self.op_kwargs(lower)

        def f(q, k, v, md):
            return self.op(q, k, v, md, sm_scale=lower.d**-0.5, config=lower.config, **kw)

        traced = jax.jit(f).trace(q, kv, kv, md)
        assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
