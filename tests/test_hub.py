"""Hugging Face Hub model ids, offline: a Hub cache built on disk in huggingface_hub's layout
(tests/hub_cache.py) holds a tiny random Llama at two commits; HF_HUB_OFFLINE=1 and download_dir pointing
at the cache. A Hub id loads the same parameters as the folder it came from and generates what
transformers generates from that folder; --revision picks the other commit; a path that exists wins over
a Hub id; an id that is not there is one error line naming it, in Python and from the command line.
Then the same client against a Hub on 127.0.0.1 (tests/fake_hub.py): only the files the model reads are
downloaded, HF_TOKEN opens a gated model, the Hub's errors become one line naming the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxllm.config import ModelSpec
from jaxllm.hub import ModelNotFoundError, is_hub_model_id
from jaxllm.loader import load_model, resolve_model
from jaxllm.testing.tiny_models import save_tiny_llama
from tests.fake_hub import FakeHub, folder_files
from tests.hub_cache import add_snapshot

REPO = "tiny-org/tiny-llama"
COMMIT_A = "0123456789abcdef0123456789abcdef01234567"  # main
COMMIT_B = "89abcdef0123456789abcdef0123456789abcdef"  # tag v2: other weights
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    a = save_tiny_llama(str(root / "a"), seed=0)
    b = save_tiny_llama(str(root / "b"), seed=1)
    config_only = root / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_bytes(open(os.path.join(a, "config.json"), "rb").read())
    cache = str(root / "cache")
    add_snapshot(cache, REPO, a, COMMIT_A, refs=("main",))
    add_snapshot(cache, REPO, b, COMMIT_B, refs=("v2",))
    add_snapshot(cache, "tiny-org/config-only", str(config_only), COMMIT_A, refs=("main",))
    return {"cache": cache, "a": a, "b": b}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_ENDPOINT", raising=False)


def same_params(x, y) -> bool:
    leaves_x, tree_x = jax.tree.flatten(x)
    leaves_y, tree_y = jax.tree.flatten(y)
    return tree_x == tree_y and all(
        np.array_equal(np.asarray(p), np.asarray(q)) for p, q in zip(leaves_x, leaves_y)
    )


def transformers_greedy(folder: str, ids: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def test_a_hub_id_loads_the_folder_it_came_from(hub):
    from_hub = load_model(ModelSpec(model=REPO, download_dir=hub["cache"], dtype="float32"))
    from_folder = load_model(ModelSpec(model=hub["a"], dtype="float32"))
    assert same_params(from_hub.params, from_folder.params)
    assert from_hub.model_name == REPO  # the id, as vLLM names it (the snapshot folder is a commit hash)
    assert from_hub.source.endswith(os.path.join("snapshots", COMMIT_A))
    assert from_hub.tokenizer.encode(PROMPT) == from_folder.tokenizer.encode(PROMPT)
    assert from_hub.tokenizer.chat_template == from_folder.tokenizer.chat_template


@pytest.mark.parametrize("revision", ["v2", COMMIT_B])
def test_revision_picks_the_other_snapshot(hub, revision):
    other = load_model(ModelSpec(model=REPO, revision=revision, download_dir=hub["cache"], dtype="float32"))
    assert same_params(other.params, load_model(ModelSpec(model=hub["b"], dtype="float32")).params)
    assert not same_params(other.params, load_model(ModelSpec(model=hub["a"], dtype="float32")).params)


def test_llm_generates_from_a_hub_id_what_transformers_does(hub, tmp_path, caplog):
    from jaxllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for revision, folder in ((None, hub["a"]), ("v2", hub["b"])):
        with caplog.at_level("INFO", logger="jaxllm"):
            llm = LLM(
                REPO,
                revision=revision,
                download_dir=hub["cache"],
                dtype="float32",
                max_model_len=64,
                compilation_cache_dir=str(tmp_path / "xla"),
                trust_remote_code=True,
            )
        assert llm.llm_engine.loaded.model_name == REPO
        out = llm.generate([PROMPT], greedy, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == transformers_greedy(folder, out.prompt_token_ids, 8)
        outputs[revision] = out.outputs[0].token_ids
        del llm
    assert outputs[None] != outputs["v2"]
    assert "--trust-remote-code has no effect in jaxllm" in caplog.text


def test_a_path_that_exists_wins_over_a_hub_id(hub, tmp_path, monkeypatch):
    local = tmp_path / REPO  # ./tiny-org/tiny-llama, holding snapshot B's files while main is A
    local.parent.mkdir()
    os.symlink(hub["b"], local)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_model_id(REPO)
    spec = ModelSpec(model=REPO, download_dir=hub["cache"])
    assert resolve_model(spec) is spec
    loaded = load_model(ModelSpec(model=REPO, download_dir=hub["cache"], dtype="float32"))
    assert same_params(loaded.params, load_model(ModelSpec(model=hub["b"], dtype="float32")).params)


def test_random_weights_need_only_the_config(hub):
    loaded = load_model(
        ModelSpec(model="tiny-org/config-only", load_format="dummy", download_dir=hub["cache"])
    )
    reference = load_model(ModelSpec(model=hub["a"], load_format="dummy"))
    assert loaded.arch == reference.arch and loaded.model_name == "tiny-org/config-only"


def test_a_hub_tokenizer_at_its_own_revision(hub):
    spec = resolve_model(
        ModelSpec(model=hub["a"], tokenizer=REPO, tokenizer_revision="v2", download_dir=hub["cache"])
    )
    assert spec.model == hub["a"] and spec.tokenizer.endswith(os.path.join("snapshots", COMMIT_B))
    spec = resolve_model(ModelSpec(model=REPO, tokenizer_revision="v2", download_dir=hub["cache"]))
    assert spec.model.endswith(COMMIT_A) and spec.tokenizer.endswith(COMMIT_B)


@pytest.mark.parametrize(
    "model, revision",
    [("tiny-org/absent", None), ("meta-llama/Llama-3.1-8B-Instruct", None), (REPO, "v9")],
    ids=["absent", "gated-not-cached", "absent-revision"],
)
def test_a_model_not_in_the_cache_offline_is_one_line_naming_it(hub, model, revision):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(ModelSpec(model=model, revision=revision, download_dir=hub["cache"]))
    msg = str(e.value)
    assert "\n" not in msg and f"model {model!r}" in msg and "HF_HUB_OFFLINE" in msg and hub["cache"] in msg
    if revision is not None:
        assert f"revision {revision!r}" in msg


def test_not_hub_ids():
    assert is_hub_model_id("Qwen/Qwen2.5-7B-Instruct") and is_hub_model_id("gpt2")
    for name in (None, "/abs/path/model", "./rel/model", "a/b/c", "model.gguf", "org/x.gguf", "bad--name"):
        assert not is_hub_model_id(name), name
    assert not is_hub_model_id("tiny-llama", local_names=("tiny-llama",))


@pytest.mark.parametrize(
    "model, says",
    [("tiny-org/absent", "HF_HUB_OFFLINE is set"), ("/no/such/folder", "is neither an existing folder")],
)
def test_serve_an_absent_model_exits_with_one_line(hub, model, says):
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu", "PYTHONPATH": repo_root}
    r = subprocess.run(
        [sys.executable, "-m", "jaxllm.entrypoints.openai.api_server", "--model", model,
         "--download-dir", hub["cache"], "--max-model-len", "64"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and f"{model!r}" in errors[0] and says in errors[0], errors


# ---- a Hub on 127.0.0.1 (tests/fake_hub.py): downloads, tokens and the Hub's errors through huggingface_hub


def sharded(folder: str) -> dict[str, bytes]:
    """The folder's files with its weights split into two shards and an index, as large checkpoints come,
    plus what a repository may hold beside them that jaxllm must not download: a consolidated copy of the
    weights, PyTorch weights, and a sub-folder."""
    from safetensors.numpy import load_file, save

    files = folder_files(folder)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        files[shard] = save({k: weights[k] for k in keys})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    files["consolidated.safetensors"] = files.pop("model.safetensors")
    files["pytorch_model.bin"] = b"not read"
    files["original/params.json"] = b"{}"
    return files


@pytest.fixture
def online(monkeypatch, hub):
    with FakeHub() as fake:
        fake.add(REPO, COMMIT_A, sharded(hub["a"]))
        fake.add(REPO, COMMIT_B, folder_files(hub["b"]), refs=("v2",))
        fake.add("tiny-org/gated", COMMIT_A, folder_files(hub["a"]), token="hf_secret")
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def test_download_fetches_only_what_the_model_reads(hub, online, tmp_path):
    cache = str(tmp_path / "cache")
    loaded = load_model(ModelSpec(model=REPO, download_dir=cache, dtype="float32"))
    assert same_params(loaded.params, load_model(ModelSpec(model=hub["a"], dtype="float32")).params)
    assert loaded.model_name == REPO
    assert online.downloaded(REPO) == {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
        "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    }  # fmt: skip
    # The second look-up is by the commit of the first: the branch is resolved once.
    assert [p for m, p, _ in online.requests if "/revision/" in p] == [f"/api/models/{REPO}/revision/main"]
    # Now cached: offline, the same id loads without the Hub.
    online.requests.clear()
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        again = load_model(ModelSpec(model=REPO, download_dir=cache, dtype="float32"))
    finally:
        del os.environ["HF_HUB_OFFLINE"]
    assert same_params(again.params, loaded.params) and online.requests == []
    other = resolve_model(ModelSpec(model=REPO, revision="v2", download_dir=cache))
    assert other.model.endswith(COMMIT_B)


def test_a_gated_model_needs_hf_token(online, tmp_path, monkeypatch):
    spec = ModelSpec(model="tiny-org/gated", download_dir=str(tmp_path / "cache"))
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(spec)
    assert "'tiny-org/gated' is gated" in str(e.value) and "HF_TOKEN" in str(e.value)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert resolve_model(spec).model.endswith(COMMIT_A)
    assert ("GET", "/api/models/tiny-org/gated/revision/main", "Bearer hf_secret") in online.requests


@pytest.mark.parametrize(
    "model, revision, says",
    [
        ("tiny-org/absent", None, "is neither a local path nor a model on the Hugging Face Hub"),
        (REPO, "v9", "has no revision 'v9' (--revision)"),
    ],
)
def test_hub_errors_name_the_model(online, tmp_path, model, revision, says):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(ModelSpec(model=model, revision=revision, download_dir=str(tmp_path / "cache")))
    assert str(e.value) == f"model {model!r} {says}" + (
        " (a private model needs HF_TOKEN)" if revision is None else " on the Hugging Face Hub"
    )
