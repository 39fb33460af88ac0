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

A prompt's captures can be tens of MB (a 512-token prompt, 4 layers of a 4096-wide bf16 model: 16 MB).
`base64.b64encode` holds the interpreter lock for all of it (about 40 ms for 16 MB), and the server's
engine thread, which must dispatch a step every few milliseconds, waits meanwhile. Arrays of
B64_NUMPY_BYTES and more are encoded with numpy instead (`b64encode`: a table of the 4,096 two-letter
pairs indexed by 12-bit halves of each 3 bytes), whose array loops run without the lock; the text is
the same.
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


B64_NUMPY_BYTES = 1 << 18
_ALPHABET = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", np.uint8)
# pair i = letters (i >> 6, i & 63) as two bytes of a little-endian uint16 (the first letter first in memory)
_PAIRS = (_ALPHABET[:, None].astype("<u2") | (_ALPHABET[None, :].astype("<u2") << 8)).reshape(-1)


def b64encode(buf: np.ndarray) -> str:
    """Standard base64 (padded) of a contiguous array's bytes; numpy's loops from B64_NUMPY_BYTES on."""
    flat = buf.reshape(-1).view(np.uint8)
    if flat.size < B64_NUMPY_BYTES:
        return base64.b64encode(flat.tobytes()).decode("ascii")
    whole = flat.size - flat.size % 3
    t = flat[:whole].reshape(-1, 3)
    v = (t[:, 0].astype(np.uint32) << 16) | (t[:, 1].astype(np.uint32) << 8) | t[:, 2]
    out = np.empty((v.size, 2), "<u2")
    np.take(_PAIRS, v >> 12, out=out[:, 0])
    np.take(_PAIRS, v & 0xFFF, out=out[:, 1])
    text = out.tobytes() + base64.b64encode(flat[whole:].tobytes())  # the last 1-2 bytes, padded
    return text.decode("ascii")


def encode_array(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    if a.dtype.name not in WIRE_DTYPES:
        raise ValueError(f"dtype={a.dtype.name!r} must be one of {', '.join(WIRE_DTYPES)}")
    raw = a.byteswap() if sys.byteorder == "big" else a
    return {"shape": list(a.shape), "dtype": a.dtype.name, "data": b64encode(raw)}


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
