"""GGUFHeader (the loader's reading of a GGUF file's metadata and tensor table) against the gguf package's
own GGUFReader: every field's contents and every tensor's name, type, dims and bytes, on the embedded model
and on a file written with gguf.GGUFWriter holding every metadata value type, float, integer and
quantized tensors and a non-default alignment; and the errors a damaged file gets."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from jaxllm.embedded import embedded_model_path  # noqa: E402
from jaxllm.loader.gguf_header import GGUFHeader  # noqa: E402
from jaxllm.loader.gguf_loader import open_gguf  # noqa: E402


def assert_same_as_gguf_reader(path: str) -> GGUFHeader:
    ours, ref = GGUFHeader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]  # GGUF.*: its own header
    for key, field in ours.fields.items():
        assert field.contents() == ref.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name
    return ours


def test_embedded_model_reads_as_gguf_reader_does():
    header = assert_same_as_gguf_reader(embedded_model_path())
    assert header.fields["general.architecture"].contents() == "llama"
    assert len(header.fields["tokenizer.ggml.tokens"].contents()) == 49152


def write_every_kind(path, alignment: int = 64) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ∑ ✓")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ünïcode", "x" * 300])
    w.add_array("t.bools", [True, False, True])
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 7, 2)).astype(np.float16))
    w.add_tensor("i8", rng.integers(-128, 128, (6, 9), dtype=np.int8))
    w.add_tensor("i32", rng.integers(-(2**31), 2**31, (5,), dtype=np.int32))
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16):
        x = rng.standard_normal((3, 64)).astype(np.float32)
        w.add_tensor(f"q_{qtype.name}", gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_written_file_reads_as_gguf_reader_does(tmp_path):
    path = tmp_path / "every.gguf"
    write_every_kind(path)
    header = assert_same_as_gguf_reader(str(path))
    assert header.fields["general.alignment"].contents() == 64
    assert header.fields["t.strs"].contents() == ["a", "", "ünïcode", "x" * 300]
    assert header.fields["t.u64"].contents() == 2**63 + 5


def test_damaged_files_get_errors_naming_the_file(tmp_path):
    path = tmp_path / "every.gguf"
    write_every_kind(path)
    raw = path.read_bytes()
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGUX" + raw[4:])
    with pytest.raises(ValueError, match=r"cannot read GGUF file .*magic\.gguf.*magic"):
        open_gguf(str(bad_magic))
    # cut inside the tensors' data: the table says more bytes than the file holds
    short = tmp_path / "short.gguf"
    short.write_bytes(raw[: len(raw) - 40])
    with pytest.raises(ValueError, match=r"cannot read GGUF file .*short\.gguf.*past the end"):
        open_gguf(str(short))
    # cut inside the metadata
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:200])
    with pytest.raises(ValueError, match=r"cannot read GGUF file .*cut\.gguf"):
        open_gguf(str(cut))
