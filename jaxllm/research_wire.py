"""Captures on the wire: how the server sends a request's activations in JSON, and how a client reads them.

    Captures(positions, arrays) --encode_captures--> {"positions": [...],
                                                      "captures": {site: {"shape", "dtype", "data"}}}
    that JSON object (a choice's `research`) --decode_captures--> Captures (numpy arrays)
    the `research` of each streamed chunk, in order --merge_captures--> one Captures

`data` is base64 of the array's little-endian bytes in C order, in the array's own dtype: float32 for
float32 models and for "logits", bfloat16 (2 bytes, exact) for bfloat16 models, which is half of what a
float32 copy would send. A client without ml_dtypes reads bfloat16 as uint16 and shifts it left 16 bits
into float32 (`(u16.astype(np.uint32) << 16).view(np.float32)`). Only numpy (and ml_dtypes for bfloat16)
is needed here, so clients can import this module without jax.
"""

from __future__ import annotations

import base64
import sys

import numpy as np

from jaxllm.outputs import Captures

# The dtypes a capture can have (the model's compute dtypes, f32 logits): nothing else is decoded.
WIRE_DTYPES = ("float32", "bfloat16", "float16")


def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if name not in WIRE_DTYPES:
        raise ValueError(f"dtype={name!r} must be one of {', '.join(WIRE_DTYPES)}")
    return np.dtype(name)


def encode_array(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    if a.dtype.name not in WIRE_DTYPES:
        raise ValueError(f"dtype={a.dtype.name!r} must be one of {', '.join(WIRE_DTYPES)}")
    raw = a.byteswap() if sys.byteorder == "big" else a
    return {"shape": list(a.shape), "dtype": a.dtype.name, "data": base64.b64encode(raw.tobytes()).decode()}


def decode_array(obj: dict) -> np.ndarray:
    dtype = _numpy_dtype(obj["dtype"])
    a = np.frombuffer(base64.b64decode(obj["data"]), dtype=dtype)
    if sys.byteorder == "big":
        a = a.byteswap()
    return a.reshape(obj["shape"])


def encode_captures(c: Captures) -> dict:
    """A choice's `research` object: the positions, and each site's array (one row per position)."""
    return {
        "positions": [int(p) for p in c.positions],
        "captures": {site: encode_array(a) for site, a in c.arrays.items()},
    }


def decode_captures(choice_research: dict) -> Captures:
    """A choice's `research` object (a dict, as JSON gives it) -> Captures with numpy arrays."""
    arrays = {site: decode_array(a) for site, a in choice_research["captures"].items()}
    return Captures(list(choice_research["positions"]), arrays)


def merge_captures(parts: list[Captures]) -> Captures:
    """A stream's captures, chunk after chunk (each holds the positions new in it), as one Captures."""
    if not parts:
        return Captures([], {})
    positions = [p for c in parts for p in c.positions]
    arrays = {site: np.concatenate([c.arrays[site] for c in parts]) for site in parts[0].arrays}
    return Captures(positions, arrays)
