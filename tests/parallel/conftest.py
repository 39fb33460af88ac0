"""Shared pieces of the tensor-parallel tests: tiny checkpoints and one 8-device worker run.

jax in the pytest process already runs with one device, so engine cases run in subprocesses
(tests/parallel/tp_worker.py) started with `--xla_force_host_platform_device_count`; fixtures are
session-scoped so the models are built and the single-host cases run once for every test file here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxllm.testing.tiny_models import save_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "parallel", "tp_worker.py")
VOCAB = 384  # divisible by 8: embeddings and LM head split over the vocabulary
TP_SIZES = [1, 2, 4, 8]
LOGPROB_TOL = 1e-4


def worker_env(num_devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for name in ("JAXLLM_COORDINATOR_ADDRESS", "JAXLLM_NUM_PROCESSES", "JAXLLM_PROCESS_ID"):
        env.pop(name, None)
    return env


def run_single_host(spec: dict, num_devices: int) -> dict:
    """tp_worker.py's single-host cases in a process with `num_devices` CPU devices; its RESULT."""
    proc = subprocess.run(
        [sys.executable, WORKER, "single", json.dumps(spec)],
        env=worker_env(num_devices),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return parse_result(proc.stdout)


def parse_result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def save_tiny_qwen(folder: str, version: int, **overrides) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=1,
    )
    if version == 3:
        cfg["head_dim"] = 16
    cfg.update(overrides)
    config_cls, model_cls = (
        (Qwen2Config, Qwen2ForCausalLM) if version == 2 else (Qwen3Config, Qwen3ForCausalLM)
    )
    torch.manual_seed(version)
    model = model_cls(config_cls(**cfg)).to(torch.float32).eval()
    if version == 2:  # random non-zero biases, so that splitting them is tested
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def save_tiny_opt(folder: str) -> str:
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(7)
    cfg = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
        init_std=0.3,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    OPTForCausalLM(cfg).to(torch.float32).eval().save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_models")
    return {
        "llama": save_tiny_llama(
            str(root / "llama"), vocab_size=VOCAB, num_attention_heads=8, num_key_value_heads=2
        ),
        "qwen2": save_tiny_qwen(str(root / "qwen2"), 2),
        "qwen3": save_tiny_qwen(str(root / "qwen3"), 3),
        "opt": save_tiny_opt(str(root / "opt")),
        # 12 heads over 4 KV heads: TP 3 divides neither way round, TP 6 fits queries but not KV heads
        "odd": save_tiny_qwen(
            str(root / "odd"), 2, num_attention_heads=12, num_key_value_heads=4, hidden_size=96
        ),
    }


@pytest.fixture(scope="session")
def single_host(models) -> dict:
    spec = {
        "cases": [
            {"name": "llama", "model": models["llama"], "tp": TP_SIZES},
            {"name": "qwen2", "model": models["qwen2"], "tp": TP_SIZES},
            {"name": "qwen3", "model": models["qwen3"], "tp": TP_SIZES},
            {"name": "opt", "model": models["opt"], "tp": [1, 8]},
            # an fp8 KV cache: pages split over the devices as the 16-bit ones (TP 4: a slot per device)
            {
                "name": "llama-fp8",
                "model": models["llama"],
                "tp": [1, 2, 4],
                "engine": {"kv_cache_dtype": "fp8"},
            },
        ],
        "bad": [
            {"name": "llama", "model": models["llama"], "tp": [16]},
            {"name": "odd", "model": models["odd"], "tp": [5, 6]},
        ],
    }
    return run_single_host(spec, 8)


def assert_same_generation(ref: dict, got: dict, label: str) -> None:
    assert got["tokens"] == ref["tokens"], f"{label}: greedy tokens differ from TP=1"
    worst = 0.0
    for ref_seq, got_seq in zip(ref["logprobs"], got["logprobs"], strict=True):
        for ref_step, got_step in zip(ref_seq, got_seq, strict=True):
            assert set(ref_step) == set(got_step), f"{label}: top-5 token sets differ"
            worst = max(worst, max(abs(ref_step[t] - got_step[t]) for t in ref_step))
    assert worst < LOGPROB_TOL, f"{label}: logprobs differ from TP=1 by {worst}"


QUANT_TP_SIZES = [1, 2, 4]


@pytest.fixture(scope="session")
def quantized_models(tmp_path_factory) -> dict[str, tuple[str, dict]]:
    """{case: (folder, extra LLM arguments)}: one float Llama (hidden 128, so that group-32 scales of
    o_proj split over 4 devices) served as fp8 quantized at load, and its AWQ (group 32), GPTQ (act
    order, group 32) and compressed-tensors W8A8 int8 checkpoints (tests/quantization/checkpoints.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.quantization.checkpoints import write_quantized

    root = tmp_path_factory.mktemp("tp_quantized")
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.3,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(5)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(str(root / "float"), safe_serialization=True)
    write_quantized(model, str(root / "awq"), "awq", group=32)
    write_quantized(model, str(root / "gptq"), "gptq", group=32, act_order=True)
    write_quantized(model, str(root / "w8a8"), "ct-w8a8-int8")
    return {
        "fp8": (str(root / "float"), {"quantization": "fp8"}),
        "awq": (str(root / "awq"), {}),
        "gptq": (str(root / "gptq"), {}),
        "w8a8": (str(root / "w8a8"), {}),
    }


@pytest.fixture(scope="session")
def quantized_host(quantized_models) -> dict:
    cases = [
        {"name": name, "model": folder, "tp": QUANT_TP_SIZES, "engine": kw}
        for name, (folder, kw) in quantized_models.items()
    ]
    return run_single_host({"cases": cases}, 4)
