"""Roofline bounds for decode steps and offline workloads, from a model's shape and a hardware's peaks.

    ModelArchConfig --ModelShape.from_arch--> parameter counts, bytes read per decode step, KV bytes per token
    workload (input/output lengths, batch limit) --offline_bound--> Bound (seconds, tok/s, what dominates)
    Bound + measured seconds --roofline_line--> the one line every benchmark report prints

Decode is bandwidth-bound: one step reads every matmul weight once (the embedding table is only gathered,
row by row, so it does not count unless it is tied to the LM head) plus the KV of every token of context of
every sequence in the batch. Prefill is compute-bound: 2 FLOPs per matmul parameter per token, plus
attention (4 x heads x head_dim FLOPs per layer per (query, key) pair, causal). The offline bound is the
prefill FLOPs at the matmul rate plus the decode steps at the bandwidth (or their FLOPs, if larger).
A mixture-of-experts model (Mixtral, Qwen3-MoE) counts its active parameters there: attention, the router
and the K experts a token uses. That is what a single stream must read per step; a batch whose tokens
route to more experts reads more, so at larger batches the bound is optimistic (the active-parameter
bound vLLM's and others' MoE figures are quoted against).

The peaks (HARDWARE) are per card, and the bound follows the card the run is on: `--hardware auto`, every
tool's default, reads the device kind JAX reports (`jax.devices()[0].device_kind`, e.g. 'NVIDIA H100 80GB
HBM3') or, in a client that must not start JAX on the server's GPU, the name nvidia-smi prints, and looks it
up in CARD_PATTERNS (`hardware_for_kind`). A card the table does not know, or the CPU, has no bound: the
report says so instead of printing another card's. The H200's peaks are measured on one (a device-to-device
copy and a bf16 matmul through XLA): a bound a real kernel can approach, where the datasheet's 4.8 TB/s is
not reached even by a copy. The H100's bandwidth is its datasheet figure (SXM, 3.35 TB/s) and its matmul
rate the H200's measured one (the same GH100 compute die). The PCIe and NVL variants differ in both and
have no entry.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    bandwidth: float  # bytes/s of device memory
    matmul_flops: float  # FLOP/s of dense matmul at the model's dtype

    def __post_init__(self) -> None:
        if self.bandwidth <= 0:
            raise ValueError(f"bandwidth={self.bandwidth} must be > 0 (bytes/s)")
        if self.matmul_flops <= 0:
            raise ValueError(f"matmul_flops={self.matmul_flops} must be > 0 (FLOP/s)")


H200 = Hardware("H200", bandwidth=4.3e12, matmul_flops=690e12)
H100 = Hardware("H100", bandwidth=3.35e12, matmul_flops=690e12)
HARDWARE = {"h200": H200, "h100": H100}
HARDWARE_CHOICES = ("auto", *sorted(HARDWARE))
# Device kinds (JAX's, or nvidia-smi's name) -> peaks; the first pattern that matches wins. The SXM boards
# only: 'NVIDIA H100 PCIe' and 'NVIDIA H100 NVL' (other memory, other clocks) match none and get no bound.
CARD_PATTERNS: tuple[tuple[str, Hardware], ...] = (
    (r"^(nvidia )?h100( sxm\w*)?( 80gb)?( hbm3)?$", H100),
    (r"^(nvidia )?h200( sxm\w*)?( 141gb)?( hbm3e)?$", H200),
)


def hardware_for_kind(device_kind: str | None) -> Hardware | None:
    """The peaks of a card named as JAX's device_kind or nvidia-smi name it; None for any other (the CPU
    included), so that no report quotes another card's bound."""
    name = " ".join((device_kind or "").lower().split())
    for pattern, hw in CARD_PATTERNS:
        if re.match(pattern, name):
            return hw
    return None


def jax_device_kind() -> str:
    """The kind of JAX's first device: 'NVIDIA H100 80GB HBM3', 'NVIDIA H200', 'cpu', ..."""
    import jax

    return jax.devices()[0].device_kind


def hardware_for_device(choice: str = "auto", device_kind: str | None = None) -> Hardware | None:
    """The peaks named by `choice`; "auto": those of `device_kind` (default: JAX's first device), or None
    when the table has no such card."""
    if choice != "auto":
        if choice not in HARDWARE:
            raise ValueError(f"--hardware {choice!r} is not known; choose from {HARDWARE_CHOICES}")
        return HARDWARE[choice]
    return hardware_for_kind(jax_device_kind() if device_kind is None else device_kind)


def kernel_hardware(choice: str = "auto") -> Hardware:
    """For the kernel and GEMM sweeps, whose rows need some peaks to divide by: this card's, else the
    H200's (their reports name the card the bound is for, so such a row says it is the H200's)."""
    return hardware_for_device(choice) or H200


def no_bound_line(device_kind: str | None) -> str:
    """What a report prints in place of the roofline line on a card the table does not know."""
    return (
        f"roofline: n/a (no peaks known for {device_kind or 'this device'!r}; "
        f"pass --hardware {'|'.join(sorted(HARDWARE))} to quote one)"
    )


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    weight_bytes_per_param: int = 2
    kv_bytes_per_element: int = 2
    # mixture of experts (0: dense): the sparse layers' MLP is a router and E experts of width
    # moe_intermediate_size, experts_per_token of them active per token
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_moe_layers: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.weight_bytes_per_param < 1 or self.kv_bytes_per_element < 1:
            raise ValueError(
                f"weight_bytes_per_param={self.weight_bytes_per_param} and "
                f"kv_bytes_per_element={self.kv_bytes_per_element} must be >= 1"
            )

    @classmethod
    def from_arch(cls, arch: Any, dtype: str = "bfloat16", kv_dtype: str | None = None) -> ModelShape:
        """From a ModelArchConfig (or anything with its field names); dtype names as numpy/jax print them."""
        return cls(
            num_layers=arch.num_layers,
            hidden_size=arch.hidden_size,
            intermediate_size=arch.intermediate_size,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            vocab_size=arch.vocab_size,
            tie_word_embeddings=bool(arch.tie_word_embeddings),
            weight_bytes_per_param=dtype_bytes(dtype),
            kv_bytes_per_element=dtype_bytes(kv_dtype or dtype),
            num_experts=getattr(arch, "num_experts", 0),
            experts_per_token=getattr(arch, "num_experts_per_tok", 0),
            moe_intermediate_size=getattr(arch, "moe_intermediate_size", 0),
            num_moe_layers=arch.num_layers - len(getattr(arch, "dense_mlp_layers", ()))
            if getattr(arch, "num_experts", 0)
            else 0,
        )

    # ---- parameter counts (Llama family: q/k/v/o, gated MLP, two norms per layer) --------------------------
    @property
    def layer_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        attn = h * self.num_heads * hd + 2 * h * self.num_kv_heads * hd + self.num_heads * hd * h
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h

    def moe_layer_params(self, active: bool) -> int:
        """A sparse layer: attention, norms, router and all experts (or, `active`, the K a token uses)."""
        h = self.hidden_size
        dense_mlp = 3 * h * self.intermediate_size
        experts = self.experts_per_token if active else self.num_experts
        return (
            self.layer_params
            - dense_mlp
            + h * self.num_experts
            + experts * 3 * h * self.moe_intermediate_size
        )

    def _all_layers_params(self, active: bool) -> int:
        dense = self.num_layers - self.num_moe_layers
        return dense * self.layer_params + self.num_moe_layers * self.moe_layer_params(active)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self._all_layers_params(False) + self.embedding_params + head + self.hidden_size

    @property
    def matmul_params(self) -> int:
        """Parameters that multiply every token: all layers (a MoE layer's active experts) plus the LM head
        (the embedding is a gather)."""
        return self._all_layers_params(True) + self.embedding_params

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.weight_bytes_per_param

    @property
    def decode_weight_bytes(self) -> int:
        """Weights one decode step must read: everything except the untied embedding table."""
        return (self.matmul_params + self.hidden_size) * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token of context across all layers."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.kv_bytes_per_element

    def attention_flops(self, num_pairs: int) -> int:
        """QK^T and PV for `num_pairs` (query, key) pairs, summed over layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * num_pairs


def dtype_bytes(dtype: str) -> int:
    name = str(dtype).removeprefix("torch.").removeprefix("jnp.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not known; known: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def decode_step_bytes(shape: ModelShape, context_lens: Sequence[int]) -> int:
    """Bytes one decode step must move: weights once, plus the KV of every sequence's context."""
    return shape.decode_weight_bytes + shape.kv_bytes_per_token * int(sum(context_lens))


def decode_step_seconds(shape: ModelShape, context_lens: Sequence[int], hw: Hardware = H200) -> float:
    """Lower bound on one decode step for a batch with these context lengths (one new token each)."""
    flops = 2 * shape.matmul_params * len(context_lens) + shape.attention_flops(int(sum(context_lens)))
    return max(decode_step_bytes(shape, context_lens) / hw.bandwidth, flops / hw.matmul_flops)


def prefill_flops(shape: ModelShape, prompt_len: int, cached_len: int = 0) -> int:
    """A causal prompt whose first `cached_len` tokens' KV is already in the prefix cache: token i
    attends to i + 1 keys, so the tokens computed (cached_len..L-1) make L(L+1)/2 - c(c+1)/2 pairs."""
    if not 0 <= cached_len <= prompt_len:
        raise ValueError(f"cached_len={cached_len} must be in [0, prompt_len={prompt_len}]")
    pairs = prompt_len * (prompt_len + 1) // 2 - cached_len * (cached_len + 1) // 2
    return 2 * shape.matmul_params * (prompt_len - cached_len) + shape.attention_flops(pairs)


@dataclass(frozen=True, slots=True)
class Bound:
    hardware: str
    seconds: float  # lower bound on the whole workload
    prefill_seconds: float
    decode_seconds: float
    prefill_flops: float
    decode_bytes: float
    decode_flops: float
    decode_steps: int
    output_tokens: int
    total_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else math.inf

    @property
    def total_tok_s(self) -> float:
        return self.total_tokens / self.seconds if self.seconds > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s}


def offline_bound(
    shape: ModelShape,
    input_lens: Sequence[int],
    output_lens: Sequence[int],
    max_batch: int,
    hw: Hardware = H200,
    cached_lens: Sequence[int] | None = None,
) -> Bound:
    """Lower bound on serving every request: prefill at the matmul rate, decode at the bandwidth.

    `cached_lens`: prompt tokens per request whose KV a prefix cache can supply (a shared system prompt:
    its length for every request but the first); their prefill is not computed, so it is not counted.

    The prefill step of a request also yields its first output token; the other `out - 1` tokens come from
    decode steps of at most `max_batch` sequences, so there are at least max(ceil(sum(out - 1) / max_batch),
    max(out - 1)) steps, each reading the weights once. Every decode token also reads the KV of its whole
    context. An engine that mixes prefill chunks into decode steps overlaps the two terms, so it can beat
    this sum by at most the smaller term; the sum is the conventional figure and the one reported.
    """
    if len(input_lens) != len(output_lens):
        raise ValueError(f"input_lens has {len(input_lens)} entries but output_lens has {len(output_lens)}")
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch} must be >= 1")
    cached = list(cached_lens) if cached_lens is not None else [0] * len(input_lens)
    if len(cached) != len(input_lens):
        raise ValueError(f"cached_lens has {len(cached)} entries but input_lens has {len(input_lens)}")
    p_flops = sum(prefill_flops(shape, i, c) for i, c in zip(input_lens, cached, strict=True))
    decode_tokens = sum(max(o - 1, 0) for o in output_lens)
    # Decode token t (1..o-1) of a request with prompt i attends to i + t keys.
    kv_tokens = sum(
        (o - 1) * i + (o - 1) * o // 2 for i, o in zip(input_lens, output_lens, strict=True) if o > 1
    )
    # A request's tokens come one step after another, so its own length also bounds the step count.
    steps = max([math.ceil(decode_tokens / max_batch)] + [o - 1 for o in output_lens]) if decode_tokens else 0
    d_bytes = steps * shape.decode_weight_bytes + kv_tokens * shape.kv_bytes_per_token
    d_flops = 2 * shape.matmul_params * decode_tokens + shape.attention_flops(kv_tokens)
    p_s = p_flops / hw.matmul_flops
    d_s = max(d_bytes / hw.bandwidth, d_flops / hw.matmul_flops)
    return Bound(
        hardware=hw.name,
        seconds=p_s + d_s,
        prefill_seconds=p_s,
        decode_seconds=d_s,
        prefill_flops=float(p_flops),
        decode_bytes=float(d_bytes),
        decode_flops=float(d_flops),
        decode_steps=steps,
        output_tokens=int(sum(output_lens)),
        total_tokens=int(sum(input_lens) + sum(output_lens)),
    )


def roofline_line(bound: Bound, measured_seconds: float) -> str:
    """One line: the bound, what dominates it, and the share of it the measurement achieved."""
    share = bound.seconds / measured_seconds if measured_seconds > 0 else math.nan
    return (
        f"roofline ({bound.hardware}): >= {bound.seconds:.4g} s for this workload "
        f"(prefill {bound.prefill_seconds:.3g} s at {bound.prefill_flops:.3g} FLOP, decode {bound.decode_seconds:.3g} s "
        f"over {bound.decode_steps} steps moving {bound.decode_bytes:.3g} B) = {bound.output_tok_s:,.0f} output tok/s; "
        f"measured {measured_seconds:.4g} s = {100 * share:.3g}% of the bound"
    )


def shape_for_model(model: str | None, dtype: str = "auto") -> ModelShape | None:
    """The shape of a preset, HF folder or GGUF file without loading weights; None when it cannot be told.

    dtype "auto" follows the loader's choice on an accelerator: bfloat16 unless the checkpoint says float16.
    """
    from benchmarks.workload import arch_for_model

    try:
        arch = arch_for_model(model)
    except Exception:  # noqa: BLE001 - an unknown shape only drops the roofline line
        return None
    if dtype == "auto":
        dtype = "float16" if arch.dtype == "float16" else "bfloat16"
    return ModelShape.from_arch(arch, dtype)
