"""The offline API, as in vLLM: `LLM(model=...).generate(prompts, SamplingParams(...))` and `.chat()`.

All prompts are added to the engine at once, as FINAL_ONLY requests (the engine builds each request's
output once, when it finishes), and `step()` runs until every request finishes; outputs come back in
input order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jaxllm.config import CacheConfig, EngineConfig, ModelSpec, ParallelConfig, RunnerConfig, SchedulerConfig
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxllm")


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        tensor_parallel_size: int = 1,
        coordinator_address: str | None = None,
        num_processes: int = 1,
        process_id: int = 0,
        dtype: str = "auto",
        quantization: str | None = None,
        seed: int = 0,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        swap_space: float = 0.0,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        block_size: int = 16,
        num_gpu_blocks_override: int | None = None,
        kv_cache_dtype: str = "auto",
        load_format: str = "auto",
        enforce_eager: bool = False,
        compile_ahead: bool | None = None,
        attention_backend: str = "auto",
        checkpoint_dir: str | None = None,
        compilation_cache_dir: str | None = None,
        executable_cache: bool = False,
        scheduling_policy: str = "fcfs",
        async_scheduling: bool = True,
    ):
        # Size XLA's GPU memory pool from the same fraction vLLM users set (only effective before jax starts).
        from jaxllm.engine.llm_engine import LLMEngine, size_device_memory_pool

        size_device_memory_pool(gpu_memory_utilization)

        user_set = set()
        sched_kw = {
            "enable_chunked_prefill": enable_chunked_prefill,
            "policy": scheduling_policy,
            "async_scheduling": async_scheduling,
        }
        if max_num_seqs is not None:
            sched_kw["max_num_seqs"] = max_num_seqs
            user_set.add("max_num_seqs")
        if max_num_batched_tokens is not None:
            sched_kw["max_num_batched_tokens"] = max_num_batched_tokens
            user_set.add("max_num_batched_tokens")
        if not enable_chunked_prefill and max_num_batched_tokens is None:
            sched_kw["max_num_batched_tokens"] = max(max_model_len or 0, 2048)
        if max_model_len is not None:
            sched_kw["max_model_len"] = max_model_len
        config = EngineConfig(
            model=ModelSpec(
                model=model,
                tokenizer=tokenizer,
                dtype=dtype,
                load_format=load_format,
                quantization=quantization,
                seed=seed,
                max_model_len=max_model_len,
                checkpoint_dir=checkpoint_dir,
            ),
            cache=CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization,
                num_gpu_blocks_override=num_gpu_blocks_override,
                swap_space_gib=swap_space,
                enable_prefix_caching=enable_prefix_caching,
                kv_cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(**sched_kw),
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                coordinator_address=coordinator_address,
                num_processes=num_processes,
                process_id=process_id,
            ),
            runner=RunnerConfig(
                attention_backend=attention_backend,
                enforce_eager=enforce_eager,
                compile_ahead=compile_ahead,
                compilation_cache_dir=compilation_cache_dir,
                executable_cache=executable_cache,
            ),
        )
        self.llm_engine = LLMEngine(config, user_set=frozenset(user_set))

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
            sampling_params = SamplingParams()
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
