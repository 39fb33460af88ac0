"""A GGUF file's metadata and tensor table, read without decoding what the load does not use.

Why not `gguf.GGUFReader`: it decodes every metadata value up front through numpy views of a memory map,
one view per string, and a llama.cpp file carries its whole tokenizer as metadata (the embedded
SmolLM2 file: 49,152 tokens and 48,900 merges). That took most of the embedded model's start-up (about
4 s of a 7 s `LLM()` on the CPU, more on the GPU hosts' slower cores) for values jaxllm never reads: the
embedded model's tokenizer ships as tokenizer.json, and another GGUF's is built by transformers' own
reader. Here arrays are only stepped over (a string array by its length prefixes) and decoded on
`contents()`; scalars and strings are decoded as they are met.

`GGUFHeader(path)` gives what the loader uses of a GGUFReader: `fields[key].contents()`, and `tensors`,
each with `name`, `tensor_type` (gguf.GGMLQuantizationType), `shape` (the file's dims, innermost first)
and `data` (a read-only view of the memory map: float and integer types as their numpy dtype in numpy's
dim order, quantized types as bytes, one row of blocks a row, as GGUFReader gives them).

Format (GGUF v2/v3, little-endian): "GGUF", u32 version, u64 tensor count, u64 metadata count; each
metadata entry: string key, u32 value type, value (arrays: u32 element type, u64 count, elements);
each tensor: string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset from the data start,
which is the end of the table rounded up to `general.alignment` (32 when absent).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# metadata value types -> struct format of one element (STRING and ARRAY have their own layout)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# tensor types stored as plain numpy arrays; every other type is quantized blocks, read as bytes
PLAIN_TENSORS = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


@dataclass(frozen=True)
class Field:
    """One metadata value: decoded already (`value`), or an array left in the file until asked for."""

    name: str
    value: Any = None
    array: tuple[bytes | memoryview, int, int, int] | None = None  # (buffer, offset, element type, count)

    def contents(self) -> Any:
        if self.array is None:
            return self.value
        buf, offset, etype, count = self.array
        if etype == STRING:
            out = []
            for _ in range(count):
                text, offset = _string(buf, offset)
                out.append(text)
            return out
        if etype == ARRAY:
            raise ValueError(f"GGUF field {self.name}: arrays of arrays are not read")
        return list(struct.unpack_from(f"<{count}{SCALARS[etype]}", buf, offset))


class Tensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # the file's dims, innermost first
    data: np.ndarray


class GGUFHeader:
    def __init__(self, path: str):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path = path
        self.memmap = np.memmap(path, mode="r")
        buf = memoryview(self.memmap)
        if bytes(buf[:4]) != MAGIC:
            raise ValueError(f"not a GGUF file (magic {bytes(buf[:4])!r})")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not read (versions {VERSIONS}, little-endian)")
        offset = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key, offset = _string(buf, offset)
            (vtype,), offset = struct.unpack_from("<I", buf, offset), offset + 4
            field, offset = _value(buf, offset, key, vtype)
            self.fields[key] = field
        infos = []
        for _ in range(n_tensors):
            name, offset = _string(buf, offset)
            (n_dims,) = struct.unpack_from("<I", buf, offset)
            dims = np.array(struct.unpack_from(f"<{n_dims}Q", buf, offset + 4), dtype=np.uint64)
            ttype, data_offset = struct.unpack_from("<IQ", buf, offset + 4 + 8 * n_dims)
            offset += 4 + 8 * n_dims + 12
            infos.append((name, dims, ttype, data_offset))
        alignment = int(self.fields.get("general.alignment", Field("", DEFAULT_ALIGNMENT)).contents())
        start = -(-offset // alignment) * alignment
        self.tensors: list[Tensor] = []
        names = set()
        for name, dims, ttype, data_offset in infos:
            if name in names:
                raise ValueError(f"tensor {name!r} appears twice")
            names.add(name)
            qtype = GGMLQuantizationType(ttype)
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            n_elems = int(np.prod(np_dims))
            first = start + int(data_offset)
            plain = np.dtype(PLAIN_TENSORS[ttype]) if ttype in PLAIN_TENSORS else None
            block, type_size = (1, plain.itemsize) if plain is not None else GGML_QUANT_SIZES[qtype]
            n_bytes = n_elems * type_size // block
            if first + n_bytes > len(self.memmap):
                raise ValueError(
                    f"tensor {name!r} runs past the end of the file ({first + n_bytes} > {len(self.memmap)} bytes)"
                )
            data = self.memmap[first : first + n_bytes]
            if plain is not None:
                data = data.view(plain).reshape(np_dims)
            else:
                data = data.reshape(quant_shape_to_byte_shape(np_dims, qtype))
            self.tensors.append(Tensor(name, qtype, dims, data))


def _string(buf, offset: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, offset)
    return bytes(buf[offset + 8 : offset + 8 + n]).decode("utf-8"), offset + 8 + n


def _value(buf, offset: int, key: str, vtype: int) -> tuple[Field, int]:
    if vtype == STRING:
        s, offset = _string(buf, offset)
        return Field(key, s), offset
    if vtype in SCALARS:
        fmt = "<" + SCALARS[vtype]
        return Field(key, struct.unpack_from(fmt, buf, offset)[0]), offset + struct.calcsize(fmt)
    if vtype != ARRAY:
        raise ValueError(f"metadata {key!r} has unknown value type {vtype}")
    etype, count = struct.unpack_from("<IQ", buf, offset)
    offset += 12
    field = Field(key, array=(buf, offset, etype, count))
    if etype == STRING:  # stepped over by the length prefixes
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", buf, offset)
            offset += 8 + n
    elif etype in SCALARS:
        offset += count * struct.calcsize("<" + SCALARS[etype])
    else:
        raise ValueError(f"metadata {key!r}: arrays of type {etype} are not read")
    return field, offset
