"""Tiny random Hugging Face models and an offline byte-level BPE tokenizer, saved to a folder.

Used by the engine, loader and parallel tests and by benchmarks/gpu_engine_check.py: everything is
built in-process (no model hub), with transformers and torch (the `test` extra), which are imported only
when a model is built. Weights use a larger init range than transformers' default so that greedy
choices are far from ties and stay identical across batch compositions.
"""

from __future__ import annotations

import os

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Paged attention stores the KV cache in blocks of sixteen tokens. ",
    "héllo wörld, naïve café — 世界 你好 🙂 emoji and accents. ",
    "Continuous batching keeps the accelerator busy; prefix caching reuses blocks. ",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; : ' \" ",
]


def build_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    return fast


def save_tiny_llama(folder: str, *, vocab_size: int = 384, seed: int = 0, **overrides) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(folder, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    cfg = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.3,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder
