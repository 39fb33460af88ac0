"""GGUF projections kept quantized: Q8_0 -> int8 W8A16 g32, Q4_0/Q4_1/Q4_K -> int4 W4A16 g32, everything
else (and fused projections whose parts mix them) dequantized. Files are written with gguf.GGUFWriter
(Q8_0/Q4_0/Q4_1 quantized by the gguf package; Q4_K/Q6_K as random raw blocks, since the package cannot
quantize them and no real Q4_K file is at hand); each projection's canonical weight must equal the gguf
package's own dequantization, and the logits must equal transformers' with those weights."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from jaxllm.config import ModelSpec  # noqa: E402
from jaxllm.embedded import embedded_model_path  # noqa: E402
from jaxllm.layers.linear import dequantize  # noqa: E402
from jaxllm.loader import load_model  # noqa: E402
from jaxllm.loader.checkpoint import CheckpointCache  # noqa: E402
from jaxllm.loader.gguf_blocks import decode_int4  # noqa: E402
from jaxllm.loader.gguf_loader import gguf_hf_config, gguf_layer_quant, open_gguf  # noqa: E402
from jaxllm.loader.loader import params_layout  # noqa: E402
from jaxllm.quantization.scheme import LayerQuant, QuantScheme  # noqa: E402
from tests.loader.test_gguf_writer import random_k_blocks, write_llama_gguf  # noqa: E402
from tests.models.paged_runner import PagedRunner  # noqa: E402

CFG = dict(
    vocab_size=300, hidden_size=256, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
PARTS = {  # HF module -> GGUF tensor
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
LAYER_TYPES = [
    # every 4-bit type, fused with one another (one int4 g32 layout); Q8_0 alone
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_K, "attn_v": Q.Q4_1, "attn_output": Q.Q4_1,
     "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0},
    # Q4_0 q/k beside a Q6_K v, Q8_0 beside Q4_1, F16: dequantized
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q6_K, "attn_output": Q.Q8_0,
     "ffn_gate": Q.Q8_0, "ffn_up": Q.Q4_1, "ffn_down": Q.F16},
    # all-Q8_0 fused projections
    {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_K,
     "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_0},
]  # fmt: skip
INT4 = QuantScheme("gguf", "int4", group_size=32)
INT8 = QuantScheme("gguf", "int8", group_size=32)
EXPECTED_SCHEMES = [
    {"qkv_proj": INT4, "o_proj": INT4, "gate_up_proj": INT4, "down_proj": INT8},
    {"qkv_proj": None, "o_proj": INT8, "gate_up_proj": None, "down_proj": None},
    {"qkv_proj": INT8, "o_proj": INT4, "gate_up_proj": INT8, "down_proj": INT4},
]
PROJ_PARTS = {
    "attn/qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn/o_proj": ("self_attn.o_proj",),
    "mlp/gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp/down_proj": ("mlp.down_proj",),
}


def raw_blocks(rng, x: np.ndarray, qtype) -> np.ndarray:
    """The file's data for x [out, in] stored as qtype."""
    if qtype == Q.F16:
        return x.astype(np.float16)
    if qtype == Q.Q6_K:
        return random_k_blocks(rng, qtype, *x.shape)
    if qtype == Q.Q4_K:
        raw = random_k_blocks(rng, qtype, *x.shape).reshape(x.shape[0], -1, 144)
        raw[::3, :, 4:8] = 0  # sub-blocks 0-3 with scale 0 but a nonzero min: constant groups
        return raw.reshape(x.shape[0], -1)
    x = x.copy()
    x[1] = 0.0  # d = 0 in every type
    x[2] = 0.05  # Q4_1: d = 0, m = 0.05
    return gguf.quants.quantize(x, qtype)


def write_mixed_gguf(path, state: dict, rng) -> dict:
    """Writes the file; returns the HF-layout float32 weights it holds (the gguf package's dequantization)."""
    heads = {"attn_q": CFG["num_attention_heads"], "attn_k": CFG["num_key_value_heads"]}

    def tensors():
        yield (
            "token_embd.weight",
            "model.embed_tokens.weight",
            state["model.embed_tokens.weight"],
            Q.Q8_0,
            None,
        )
        for i, types in enumerate(LAYER_TYPES):
            for hname, gname in PARTS.items():
                full = f"model.layers.{i}.{hname}.weight"
                yield f"blk.{i}.{gname}.weight", full, state[full], types[gname], heads.get(gname)
            for hname, gname in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")):
                full = f"model.layers.{i}.{hname}.weight"
                yield f"blk.{i}.{gname}.weight", full, state[full], Q.F32, None
        yield "output_norm.weight", "model.norm.weight", state["model.norm.weight"], Q.F32, None
        yield "output.weight", "lm_head.weight", state["lm_head.weight"], Q.Q6_K, None

    return write_llama_gguf(path, CFG, tensors(), lambda x, qtype: raw_blocks(rng, x, qtype))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CFG)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).eval()
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    path = tmp_path_factory.mktemp("gguf") / "mixed.gguf"
    held = write_mixed_gguf(path, state, rng)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in held.items()}, strict=False)
    return str(path), held, model


def test_layer_quant_follows_tensor_types(mixed, caplog):
    path, _, _ = mixed
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        loaded = load_model(ModelSpec(model=path, dtype="float32"))
    want = tuple(LayerQuant(overrides=tuple(e.items())) for e in EXPECTED_SCHEMES)
    assert loaded.arch.layer_quant == want
    for i, expected in enumerate(EXPECTED_SCHEMES):
        layer = loaded.params[f"layers_{i}"]
        for module in PROJ_PARTS:
            group, proj = module.split("/")
            leaves = layer[group][proj]
            scheme = expected[proj]
            if scheme is None:
                assert set(leaves) == {"kernel"}
            else:
                q = leaves["qweight"]
                assert q.dtype == (jnp.uint8 if scheme.weights == "int4" else jnp.int8)
                assert leaves["scales"].shape[0] == q.shape[0] * (2 if scheme.weights == "int4" else 1) // 32
    log = caplog.text
    assert "int4 W4A16 g32: qkv_proj[Q4_0+Q4_K+Q4_1] x1" in log
    assert "int8 W8A16 g32: down_proj[Q8_0] x1" in log
    assert "dequantized: qkv_proj[Q4_0+Q4_0+Q6_K] x1, gate_up_proj[Q8_0+Q4_1] x1, down_proj[F16] x1" in log


def test_projections_equal_gguf_dequantize_and_logits_match_transformers(mixed):
    path, held, model = mixed
    loaded = load_model(ModelSpec(model=path, dtype="float32"))
    for i, expected in enumerate(EXPECTED_SCHEMES):
        for module, parts in PROJ_PARTS.items():
            group, proj = module.split("/")
            leaves = loaded.params[f"layers_{i}"][group][proj]
            scheme = expected[proj]
            got = np.asarray(
                leaves["kernel"] if scheme is None else dequantize(leaves, scheme, jnp.float32)
            )  # [K, N]
            want = np.concatenate([held[f"model.layers.{i}.{p}.weight"].T for p in parts], axis=1)
            scale = np.abs(want).max()
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * scale, err_msg=f"layer {i} {proj}")

    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, 300, size=n).tolist() for n in (3, 9)]
    ours = PagedRunner(loaded, max_len=16).prefill(prompts)
    with torch.no_grad():
        for got, prompt in zip(ours, prompts, strict=True):
            ref = model(torch.tensor([prompt])).logits[0].numpy()
            np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_orbax_cache_keeps_the_quantized_tree(mixed, tmp_path):
    path, _, _ = mixed
    cache = str(tmp_path / "orbax")
    first = load_model(ModelSpec(model=path, dtype="float32", checkpoint_dir=cache))
    second = load_model(ModelSpec(model=path, dtype="float32", checkpoint_dir=cache, quantization="gguf"))
    assert not first.from_cache and second.from_cache
    assert second.arch.layer_quant == first.arch.layer_quant is not None
    a, b = first.params["layers_2"]["attn"]["qkv_proj"], second.params["layers_2"]["attn"]["qkv_proj"]
    assert set(a) == set(b) == {"qweight", "scales"} and b["qweight"].dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(a["qweight"]), np.asarray(b["qweight"]))
    # a cache of the dequantized (float) tree, as made before, has another key and is never restored
    assert CheckpointCache(cache, path, "float32", params_layout(1, kind="gguf")).valid()
    assert not CheckpointCache(cache, path, "float32", params_layout(1)).valid()
    assert not CheckpointCache(cache, path, "float32", params_layout(1, "gguf")).valid()


def test_q4_k_constant_sub_blocks_hand_computed():
    """One Q4_K block, d=1, dmin=0.5, 6-bit scales/mins above 15 (their top bits live in other bytes) and
    scale 0 with a nonzero min in sub-block 0: w = d sc_j q - dmin m_j, a constant -dmin m_0 there."""
    sc = np.array([0, 1, 2, 3, 63, 5, 16, 40], np.uint8)
    mn = np.array([4, 0, 1, 2, 3, 60, 7, 33], np.uint8)
    packed = np.concatenate(
        [sc[:4] | ((sc[4:] >> 4) << 6), mn[:4] | ((mn[4:] >> 4) << 6), (sc[4:] & 0xF) | ((mn[4:] & 0xF) << 4)]
    ).astype(np.uint8)
    q = np.random.default_rng(2).integers(0, 16, size=(8, 32)).astype(np.uint8)  # sub-block j, element e
    nibbles = (q[0::2] | (q[1::2] << 4)).reshape(-1)  # chunk c: sub-block 2c low, 2c + 1 high
    block = np.concatenate([np.array([1.0, 0.5], np.float16).view(np.uint8), packed, nibbles])
    want = (sc[:, None] * q.astype(np.float32) - 0.5 * mn[:, None]).reshape(1, 256)
    np.testing.assert_array_equal(gguf.quants.dequantize(block.reshape(1, -1), Q.Q4_K), want)

    leaves = decode_int4(block.reshape(1, -1), "Q4_K")  # [N=1, ...]
    canonical = {k: jnp.asarray(v.T) for k, v in leaves.items()}  # [K, N] as the loader transposes
    got = np.asarray(dequantize(canonical, INT4, jnp.float32)).T
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[0, :32], -2.0)  # the constant sub-block, exactly


def test_quantization_flag_other_than_gguf_is_refused(mixed):
    path, _, _ = mixed
    with pytest.raises(ValueError, match="quantization='fp8'.*mixed.gguf"):
        load_model(ModelSpec(model=path, quantization="fp8"))


def test_embedded_model_projections_are_int4():
    """SmolLM2's GGUF is Q4_1 in every projection: all 120 served int4 (its Q8_0 embedding stays float)."""
    path = embedded_model_path()
    layers = gguf_layer_quant(gguf_hf_config(open_gguf(path), path), path)
    projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert layers == (LayerQuant(overrides=tuple((p, INT4) for p in projections)),) * 30
