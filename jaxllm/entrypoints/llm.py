"""The offline API, as in vLLM: `LLM(model=...).generate(prompts, SamplingParams(...))` and `.chat()`.

All prompts are added to the engine at once, as FINAL_ONLY requests (the engine builds each request's
output once, when it finishes), and `step()` runs until every request finishes; outputs come back in
input order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jaxllm.engine_args import engine_args_from_kwargs
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxllm")


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        """`model`: an HF folder, a GGUF file or a preset (None: the embedded SmolLM2-135M-Instruct); the
        keywords are the fields of `jaxllm.engine_args.EngineArgs` (vLLM's names, e.g. max_model_len,
        tensor_parallel_size, gpu_memory_utilization); an unknown one is a TypeError naming it."""
        from jaxllm.engine.llm_engine import LLMEngine

        args = engine_args_from_kwargs("LLM()", model, kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args, usage="offline")

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use when given no sampling params: SamplingParams with the model's
        generation config applied (--generation-config / generation_config=; vLLM's behaviour)."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        items = _normalize_prompts(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (
            [sampling_params] * len(items)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(items):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(items)} prompts")
        engine = self.llm_engine
        # Nothing reads a request's output before it finishes: ask for its final one alone (a clone per
        # distinct params object, so the caller's stays as it was).
        final: dict[int, SamplingParams] = {}
        for sp in params:
            if id(sp) not in final and isinstance(sp, SamplingParams):
                final[id(sp)] = (
                    sp
                    if sp.output_kind is RequestOutputKind.FINAL_ONLY
                    else sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                )
        params = [final.get(id(sp), sp) for sp in params]
        # Validate everything before adding anything, so a bad prompt leaves the engine untouched.
        parents = [
            engine.prepare_request(
                engine.next_request_id(), p, sp, priority=(priority[i] if priority is not None else 0)
            )
            for i, (p, sp) in enumerate(zip(items, params))
        ]
        order = {p.request_id: i for i, p in enumerate(parents)}
        for p in parents:
            engine.enqueue(p)
        results: list[RequestOutput | None] = [None] * len(parents)
        bar = _progress(len(parents), use_tqdm)
        while engine.has_unfinished_requests():
            for out in engine.step():
                i = order.get(out.request_id)
                if i is not None and out.finished:
                    results[i] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        from jaxllm.tokenizer import apply_chat_template

        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            apply_chat_template(self.llm_engine.tokenizer, conv, add_generation_prompt=add_generation_prompt)
            for conv in convs
        ]
        # The template already holds the special tokens: encode without adding a BOS again.
        ids = [self.llm_engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(None, sampling_params, prompt_token_ids=ids, use_tqdm=use_tqdm)


def _normalize_prompts(prompts, prompt_token_ids) -> list[str | list[int]]:
    if prompt_token_ids is not None:
        return [list(p) for p in prompt_token_ids]
    if prompts is None:
        raise ValueError("prompts or prompt_token_ids must be given")
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    out = []
    for p in prompts:
        if isinstance(p, dict) and "prompt_token_ids" in p:
            out.append(list(p["prompt_token_ids"]))
        elif isinstance(p, dict) and "prompt" in p:
            out.append(p["prompt"])
        else:
            out.append(p if isinstance(p, str) else list(p))
    return out


def _progress(total: int, enabled: bool):
    if not enabled or total <= 1:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
