"""GGUF files written here with gguf.GGUFWriter (F32/F16/BF16/Q8_0/Q4_0 quantized by the gguf package,
Q4_K/Q6_K as random raw blocks since the package cannot quantize them): the loader must map names, undo
the Q/K rotary permutation, dequantize, and give the same logits as transformers with the same weights."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from jaxllm.config import ModelSpec  # noqa: E402
from jaxllm.loader import load_model  # noqa: E402
from tests.models.paged_runner import PagedRunner  # noqa: E402

CFG = dict(
    vocab_size=300, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
QUANT = {  # per HF weight: how it is stored in the file
    "self_attn.q_proj": Q.F16,
    "self_attn.k_proj": Q.Q8_0,
    "self_attn.v_proj": Q.Q4_0,
    "self_attn.o_proj": Q.Q4_K,
    "mlp.gate_proj": Q.Q4_0,
    "mlp.up_proj": Q.BF16,
    "mlp.down_proj": Q.Q6_K,
}
GGUF_NAME = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (interleaves the rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(rng, qtype, rows: int, cols: int) -> np.ndarray:
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    small = np.array([0.002], np.float16).view(np.uint8)
    if qtype == Q.Q4_K:  # d, dmin (f16) lead the block
        raw[..., 0:2] = small
        raw[..., 2:4] = small
    else:  # Q6_K: int8 scales [192:208], then d (f16)
        raw[..., 192:208] = rng.integers(-4, 5, size=raw[..., 192:208].shape).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = small
    return raw.reshape(rows, -1)


def write_llama_gguf(path, cfg: dict, tensors, encode) -> dict:
    """Writes a llama GGUF file with cfg's header and `tensors`, each (GGUF name, HF name, x [out, in] in HF
    layout, qtype, heads whose rotary rows llama.cpp permutes or None), stored as encode(x as stored,
    qtype) (F32 as is); returns the HF-layout float32 weights the file really holds (the gguf package's
    dequantization, the permutation undone)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    held = {}
    for gname, hname, x, qtype, n_head in tensors:
        stored = llama_cpp_permute(x, n_head) if n_head else x
        data = stored if qtype == Q.F32 else encode(stored, qtype)
        back = data if qtype == Q.F32 else gguf.quants.dequantize(data, qtype)
        if n_head:  # invert the row permutation by index, independently of the loader's code
            unperm = np.empty_like(back)
            unperm[llama_cpp_permute(np.arange(x.shape[0]), n_head)] = back
            back = unperm
        w.add_tensor(gname, data, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
        held[hname] = np.asarray(back, np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def write_gguf(path, hf_state: dict, rng) -> dict:
    """Writes the file; returns the HF-layout float32 weights it really holds (after quantization)."""

    def encode(stored: np.ndarray, qtype) -> np.ndarray:
        if qtype == Q.F16:
            return stored.astype(np.float16)
        if qtype in (Q.Q4_K, Q.Q6_K):
            return random_k_blocks(rng, qtype, *stored.shape)
        return gguf.quants.quantize(stored, qtype)

    heads = {"self_attn.q_proj": CFG["num_attention_heads"], "self_attn.k_proj": CFG["num_key_value_heads"]}

    def tensors():
        yield (
            "token_embd.weight",
            "model.embed_tokens.weight",
            hf_state["model.embed_tokens.weight"],
            Q.Q8_0,
            None,
        )
        for i in range(CFG["num_hidden_layers"]):
            for hname, gname in GGUF_NAME.items():
                full = f"model.layers.{i}.{hname}.weight"
                yield (
                    f"blk.{i}.{gname}.weight",
                    full,
                    hf_state[full],
                    QUANT.get(hname, Q.F32),
                    heads.get(hname),
                )
        yield "output_norm.weight", "model.norm.weight", hf_state["model.norm.weight"], Q.F32, None
        yield "output.weight", "lm_head.weight", hf_state["lm_head.weight"], Q.Q6_K, None

    return write_llama_gguf(path, CFG, tensors(), encode)


def test_written_gguf_matches_transformers(tmp_path):
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CFG)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).eval()
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    for k in state:
        if "norm" in k:
            state[k] = state[k] + 0.1 * rng.standard_normal(state[k].shape).astype(np.float32)
    held = write_gguf(tmp_path / "tiny.gguf", state, rng)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in held.items()}, strict=False)

    loaded = load_model(ModelSpec(model=str(tmp_path / "tiny.gguf"), dtype="float32"))
    assert loaded.tokenizer is None and not loaded.arch.tie_word_embeddings
    p = loaded.params
    # q|k|v fused side by side (one shard): q's columns first, then k's, then v's
    q_cols = CFG["hidden_size"]  # num_attention_heads x head_dim
    qkv1, qkv0 = (np.asarray(p[f"layers_{i}"]["attn"]["qkv_proj"]["kernel"]) for i in (1, 0))
    np.testing.assert_array_equal(qkv1[:, :q_cols], held["model.layers.1.self_attn.q_proj.weight"].T)
    k0 = held["model.layers.0.self_attn.k_proj.weight"].T
    np.testing.assert_array_equal(qkv0[:, q_cols : q_cols + k0.shape[1]], k0)
    gate_up = np.asarray(p["layers_0"]["mlp"]["gate_up_proj"]["kernel"])
    np.testing.assert_array_equal(
        gate_up[:, CFG["intermediate_size"] :], held["model.layers.0.mlp.up_proj.weight"].T
    )
    np.testing.assert_array_equal(np.asarray(p["lm_head"]["kernel"]), held["lm_head.weight"].T)

    prompts = [rng.integers(4, 300, size=n).tolist() for n in (3, 9)]
    ours = PagedRunner(loaded, max_len=16).prefill(prompts)
    with torch.no_grad():
        for got, prompt in zip(ours, prompts, strict=True):
            ref = model(torch.tensor([prompt])).logits[0].numpy()
            np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_q4_k_block_layout_hand_computed():
    """One Q4_K block with d=1, dmin=0 and every sub-block scale 1: values are the raw nibbles, laid out as
    64-element chunks (low nibbles of 32 bytes, then their high nibbles)."""
    from jaxllm.loader.gguf_loader import dequantize_tensor

    rng = np.random.default_rng(1)
    qs = rng.integers(0, 256, size=128, dtype=np.uint8)
    scales = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8)
    block = np.concatenate([np.array([1.0, 0.0], np.float16).view(np.uint8), scales, qs])
    expected = np.concatenate([np.concatenate([c & 0xF, c >> 4]) for c in qs.reshape(4, 32)]).astype(
        np.float32
    )

    class Tensor:
        name, tensor_type, data = "t", Q.Q4_K, block.reshape(1, -1)

    np.testing.assert_array_equal(dequantize_tensor(Tensor, "x.gguf").reshape(-1), expected)
