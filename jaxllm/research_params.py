"""What one request asks of the model's insides: activations to capture and steering to apply.

    SamplingParams(research=ResearchParams(capture=["residual.3", "final_norm"],
                                           capture_positions="all",
                                           steer=[Steer("residual.5", vector, scale=4.0)]))

Sites (shared by jaxllm.research and the compiled step):
    "residual.i"   the residual stream after decoder layer i (its output, before the final norm);
                   transformers' output_hidden_states[i + 1] for i < L - 1
    "attn_out.i"   layer i's attention block output (o_proj's), before it joins the residual
    "mlp_out.i"    layer i's MLP output (down_proj's), before it joins the residual
    "final_norm"   the final norm's output, what the LM head reads
    "logits"       f32 logits (capture only)

Positions are the model's input positions: prompt token p is position p; a generated token is fed back as
the next position, so a request with P prompt tokens and G generated ones has positions 0 .. P + G - 2
("prompt": 0 .. P - 1, "generated": P .. P + G - 2, "all": both). The last generated token never goes
through the model.

Interventions, inside the compiled step, on the request's own rows only (other requests in the same batch
are untouched); at one site they apply in this order, and a capture there reads the result, the value
that flows on:
    Scale(site, factor, head=None)   multiply by `factor` at every position (0 ablates); with `head`, only
                                     that query head's share of attn_out, before o_proj
    Steer(site, vector, scale)       add `scale * vector` at every position (prompt and generated)
    Patch(site, position, vector)    replace the value at one position (activation patching)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

LAYER_SITES = ("residual", "attn_out", "mlp_out")
MODEL_SITES = ("final_norm", "logits")
CAPTURE_POSITIONS = ("prompt", "generated", "all")


@dataclass(frozen=True, slots=True)
class Site:
    kind: str  # one of LAYER_SITES or MODEL_SITES
    layer: int | None = None  # None for the MODEL_SITES

    def __str__(self) -> str:
        return self.kind if self.layer is None else f"{self.kind}.{self.layer}"


def parse_site(name: str, field_name: str = "capture") -> Site:
    """ "residual.3" -> Site("residual", 3); raises ValueError naming the field."""
    if not isinstance(name, str):
        raise ValueError(f"{field_name}: {name!r} is not a site name (a string such as 'residual.3')")
    kind, dot, layer = name.partition(".")
    if kind in MODEL_SITES and not dot:
        return Site(kind)
    if kind in LAYER_SITES and dot and layer.isdigit():
        return Site(kind, int(layer))
    raise ValueError(
        f"{field_name}: {name!r} is not a site: one of {', '.join(f'{s}.<layer>' for s in LAYER_SITES)}, "
        f"{', '.join(MODEL_SITES)}"
    )


def _vector(value, field_name: str) -> np.ndarray:
    v = np.asarray(value, dtype=np.float32)
    if v.ndim != 1 or not v.size:
        raise ValueError(f"{field_name}: must be a non-empty 1-D list of numbers, got shape {v.shape}")
    if not np.all(np.isfinite(v)):
        raise ValueError(f"{field_name}: must be finite")
    return v


def _layer_site(name: str, field_name: str) -> Site:
    s = parse_site(name, field_name)
    if s.layer is None:
        raise ValueError(f"{field_name}: {name!r} must be a layer site ({', '.join(LAYER_SITES)})")
    return s


@dataclass(frozen=True, slots=True, eq=False)
class Steer:
    """Add `scale * vector` (f32[H]) at a layer site of this request's every position."""

    site: str
    vector: np.ndarray | Sequence[float]
    scale: float = 1.0

    def __post_init__(self) -> None:
        _layer_site(self.site, "steer.site")
        v = _vector(self.vector, "steer.vector")
        if not np.isfinite(self.scale):
            raise ValueError(f"steer.scale={self.scale!r} must be finite")
        object.__setattr__(self, "vector", v)
        object.__setattr__(self, "scale", float(self.scale))

    @property
    def parsed(self) -> Site:
        return parse_site(self.site, "steer.site")


@dataclass(frozen=True, slots=True, eq=False)
class Scale:
    """Multiply a layer site's activation by `factor` at every position of the request (0 ablates it);
    with `head`, only that query head's share of the attention output, before o_proj (site attn_out.i)."""

    site: str
    factor: float = 0.0
    head: int | None = None

    def __post_init__(self) -> None:
        s = _layer_site(self.site, "scale.site")
        if not np.isfinite(self.factor):
            raise ValueError(f"scale.factor={self.factor!r} must be finite")
        if self.head is not None and (
            s.kind != "attn_out" or not isinstance(self.head, int) or self.head < 0
        ):
            raise ValueError(f"scale.head={self.head!r}: a head index >= 0, on an attn_out site only")
        object.__setattr__(self, "factor", float(self.factor))

    @property
    def parsed(self) -> Site:
        return parse_site(self.site)


@dataclass(frozen=True, slots=True, eq=False)
class Patch:
    """Replace a layer site's activation at one position of the request by `vector` (activation
    patching: typically the same site's capture from another prompt)."""

    site: str
    position: int
    vector: np.ndarray | Sequence[float]

    def __post_init__(self) -> None:
        _layer_site(self.site, "patch.site")
        if not isinstance(self.position, int) or self.position < 0:
            raise ValueError(f"patch.position={self.position!r} must be a position >= 0")
        object.__setattr__(self, "vector", _vector(self.vector, "patch.vector"))

    @property
    def parsed(self) -> Site:
        return parse_site(self.site)


@dataclass(frozen=True, slots=True, eq=False)
class ResearchParams:
    capture: tuple[str, ...] = ()
    capture_positions: str = "all"
    steer: tuple[Steer, ...] = field(default=())
    scale: tuple[Scale, ...] = field(default=())
    patch: tuple[Patch, ...] = field(default=())

    def __post_init__(self) -> None:
        cap = (self.capture,) if isinstance(self.capture, str) else tuple(self.capture)
        sites = [parse_site(c, "capture") for c in cap]
        if len(set(sites)) != len(sites):
            raise ValueError(f"capture: {list(cap)} names a site twice")
        if self.capture_positions not in CAPTURE_POSITIONS:
            raise ValueError(
                f"capture_positions={self.capture_positions!r} must be one of {', '.join(CAPTURE_POSITIONS)}"
            )
        steer = tuple(s if isinstance(s, Steer) else Steer(**s) for s in self.steer)
        scale = tuple(s if isinstance(s, Scale) else Scale(**s) for s in self.scale)
        patch = tuple(p if isinstance(p, Patch) else Patch(**p) for p in self.patch)
        object.__setattr__(self, "capture", tuple(str(s) for s in sites))
        object.__setattr__(self, "steer", steer)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "patch", patch)

    @property
    def edits_model(self) -> bool:
        """Whether the request changes the forward pass (its KV is then its own)."""
        return bool(self.steer or self.scale or self.patch)

    @property
    def capture_sites(self) -> list[Site]:
        return [parse_site(c) for c in self.capture]

    def check_model(self, num_layers: int, hidden_size: int, num_heads: int) -> None:
        """Raises ValueError naming the field when a site's layer, a head or a vector's width does not fit."""
        for name, sites in (
            ("capture", self.capture_sites),
            ("steer.site", [s.parsed for s in self.steer]),
            ("scale.site", [s.parsed for s in self.scale]),
            ("patch.site", [p.parsed for p in self.patch]),
        ):
            for s in sites:
                if s.layer is not None and not 0 <= s.layer < num_layers:
                    raise ValueError(
                        f"{name}: {s} names layer {s.layer}; the model has layers 0..{num_layers - 1}"
                    )
        for name, items in (("steer.vector", self.steer), ("patch.vector", self.patch)):
            for s in items:
                if s.vector.shape != (hidden_size,):
                    raise ValueError(
                        f"{name}: {s.vector.shape[0]} numbers for {s.site}; the model's hidden size is "
                        f"{hidden_size}"
                    )
        for s in self.scale:
            if s.head is not None and s.head >= num_heads:
                raise ValueError(f"scale.head={s.head}: the model has query heads 0..{num_heads - 1}")

    def positions(self, num_prompt: int, num_computed: int) -> range:
        """The captured positions among 0 .. num_computed - 1 (the model's inputs so far)."""
        if self.capture_positions == "prompt":
            return range(min(num_prompt, num_computed))
        if self.capture_positions == "generated":
            return range(num_prompt, max(num_prompt, num_computed))
        return range(num_computed)

    def wants_position(self, p: int, num_prompt: int) -> bool:
        if self.capture_positions == "all":
            return True
        return (p < num_prompt) == (self.capture_positions == "prompt")
