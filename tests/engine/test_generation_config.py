"""--generation-config: the model's sampling defaults apply where a request leaves a field out.

Where they are read from (HF folder, GGUF metadata and a file beside it, the embedded model's card, a
folder given by path), how the override lands on top, and that LLM.generate/chat without sampling params
use them while explicit params are untouched; `vllm` turns it off."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ModelSpec
from jaxllm.embedded import EMBEDDED_GENERATION_CONFIG
from jaxllm.loader import open_model
from jaxllm.loader.generation_config import read_generation_defaults

# What a model author writes (HF names; keys that are not sampling defaults are ignored).
GENERATION_CONFIG = {
    "do_sample": True,
    "temperature": 0.0,
    "top_k": 5,
    "max_new_tokens": 7,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
EXPECTED = {"temperature": 0.0, "top_k": 5, "max_tokens": 7}  # as SamplingParams fields


@pytest.fixture(scope="module")
def folder(tiny_llama_dir, tmp_path_factory):
    """The tiny model with a generation_config.json holding sampling defaults."""
    path = str(tmp_path_factory.mktemp("with_generation_config") / "model")
    shutil.copytree(tiny_llama_dir, path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(GENERATION_CONFIG, f)
    return path


def read(mode, override, model):
    return read_generation_defaults(mode, override, open_model(ModelSpec(model=model)))


def test_sources(folder, tiny_llama_dir, tmp_path):
    g = read("auto", None, folder)
    assert dict(g.values) == EXPECTED and g.source == os.path.join(folder, "generation_config.json")
    # The tiny model's own file holds only token ids: no sampling defaults.
    assert dict(read("auto", None, tiny_llama_dir).values) == {}
    assert dict(read("vllm", None, folder).values) == {}
    # A folder given by path is read instead of the model's.
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "repetition_penalty": 1.1}))
    assert dict(read(str(other), None, folder).values) == {"top_p": 0.5, "repetition_penalty": 1.1}
    with pytest.raises(ValueError, match="--generation-config .* holds no generation_config.json"):
        read(str(tmp_path), None, folder)
    preset = open_model(ModelSpec(model="tiny-llama", load_format="dummy"))
    assert dict(read_generation_defaults("auto", None, preset).values) == {}


def test_the_embedded_model_has_its_cards_settings():
    from jaxllm.loader.loader import ModelSource

    # The embedded GGUF (spec.model None) holds no sampling keys: its model card's settings apply.
    embedded = ModelSource(ModelSpec(), "gguf", "/site-packages/x.gguf", {}, None, 1, None, False, None, 0.0)
    g = read_generation_defaults("auto", None, embedded)
    assert dict(g.values) == EMBEDDED_GENERATION_CONFIG == {"temperature": 0.2, "top_p": 0.9}
    assert "model card" in g.source


def test_override_lands_on_top(folder):
    g = read("auto", {"temperature": 0.5, "min_p": 0.1}, folder)
    assert dict(g.values) == {**EXPECTED, "temperature": 0.5, "min_p": 0.1}
    assert "--override-generation-config" in g.source
    assert dict(read("vllm", {"max_new_tokens": 4}, folder).values) == {"max_tokens": 4}


def test_bad_files_are_named(folder, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        read(str(bad), None, folder)
    (bad / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match=r"bad/generation_config.json: temperature=-1 must be >= 0"):
        read(str(bad), None, folder)


def test_gguf_metadata_then_the_file_beside_it(tmp_path):
    gguf = pytest.importorskip("gguf")
    from jaxllm.loader.gguf_loader import gguf_generation_config
    from jaxllm.loader.loader import ModelSource

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_float32("general.sampling.temp", 0.7)
    w.add_float32("general.sampling.top_p", 0.8)
    w.add_int32("general.sampling.top_k", 40)
    w.add_float32("general.sampling.mirostat_tau", 5.0)  # not a default jaxllm takes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from_file = gguf_generation_config(gguf.GGUFReader(str(path)))
    assert from_file == pytest.approx({"temperature": 0.7, "top_p": 0.8, "top_k": 40})
    source = ModelSource(
        ModelSpec(model=str(path)), "gguf", str(path), {"gguf_generation_config": from_file},
        None, 1, None, False, None, 0.0,
    )  # fmt: skip
    assert read_generation_defaults("auto", None, source).values == pytest.approx(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 40}
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    g = read_generation_defaults("auto", None, source)
    assert g.values == pytest.approx({"temperature": 0.3, "top_p": 0.8, "top_k": 40})  # the file wins
    assert "general.sampling" in g.source and "generation_config.json" in g.source


def _llm(model, cache, **kw):
    return LLM(model, dtype="float32", max_model_len=128, compilation_cache_dir=cache, **kw)


@pytest.fixture(scope="module")
def llm(folder, jax_cache_dir):
    return _llm(folder, jax_cache_dir)


def test_llm_without_params_uses_the_models_defaults(llm):
    assert llm.get_default_sampling_params() == SamplingParams(**EXPECTED)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    defaulted = llm.generate(None, prompt_token_ids=prompts, use_tqdm=False)
    reference = llm.generate(None, SamplingParams(**EXPECTED), prompt_token_ids=prompts, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in defaulted] == [o.outputs[0].token_ids for o in reference]
    # max_new_tokens=7 (SamplingParams' own default is 16): greedy, so an end before 7 is the same end
    assert all(len(o.outputs[0].token_ids) <= 7 for o in defaulted)
    assert any(len(o.outputs[0].token_ids) == 7 for o in defaulted)
    chat = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)[0].outputs[0].token_ids
    assert len(chat) <= 7


def test_explicit_params_win(llm):
    out = llm.generate(
        None, SamplingParams(max_tokens=12, ignore_eos=True), prompt_token_ids=[[5, 6, 7]], use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 12


def test_vllm_turns_them_off(folder, jax_cache_dir):
    llm = _llm(folder, jax_cache_dir, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    assert llm.llm_engine.sampling_defaults == {}


def test_override_reaches_the_engine(folder, jax_cache_dir):
    llm = _llm(folder, jax_cache_dir, override_generation_config={"max_new_tokens": 3})
    assert llm.get_default_sampling_params() == SamplingParams(**{**EXPECTED, "max_tokens": 3})
    with pytest.raises(ValueError, match=r"override_generation_config \(--override-generation-config\)"):
        _llm(
            folder, jax_cache_dir, override_generation_config={"max_tokens": 3}
        )  # the HF name is max_new_tokens
