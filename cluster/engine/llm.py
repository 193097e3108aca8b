"""LLM: the offline API, shaped like vLLM's. ``LLM(model=...).generate(prompts, SamplingParams(...))``
runs every prompt to completion with continuous batching and returns outputs in prompt order."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from cluster.common.errors import InvalidRequestError
from cluster.common.outputs import RequestOutput
from cluster.common.sampling_params import SamplingParams
from cluster.config import CacheConfig, ModelConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine
from cluster.models.tokenizer import Tokenizer

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str = "smollm2", *, device: str | None = None, dtype: str | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, block_size: int = 16,
                 kv_cache_memory_bytes: int | None = None, num_kv_blocks: int | None = None,
                 enable_prefix_caching: bool = True, seed: int = 0, async_scheduling: bool = True,
                 long_prefill_token_threshold: int = 0, prefill_step_target_s: float = 0.0,
                 sized_chunks_per_step: bool = True, slow_step_s: float | None = None,
                 **model_kwargs: Any) -> None:
        model_config = ModelConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len,
                                   seed=seed, **model_kwargs)
        cache_config = CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                                   kv_cache_memory_bytes=kv_cache_memory_bytes,
                                   enable_prefix_caching=enable_prefix_caching)
        scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                           max_num_batched_tokens=max_num_batched_tokens,
                                           async_scheduling=async_scheduling,
                                           long_prefill_token_threshold=long_prefill_token_threshold,
                                           prefill_step_target_s=prefill_step_target_s,
                                           sized_chunks_per_step=sized_chunks_per_step, slow_step_s=slow_step_s)
        self.engine = LLMEngine(model_config, cache_config, scheduler_config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        # Validate everything before adding anything: a bad prompt leaves no half-added batch.
        groups = [self.engine.make_group(f"offline-{next(self._ids)}", p, sp)
                  for p, sp in zip(prompt_list, params_list)]
        order = {g.request_id: i for i, g in enumerate(groups)}
        if len(order) != len(groups):
            raise InvalidRequestError("duplicate request ids")
        for group in groups:
            self.engine.add_group(group)
        results: list[RequestOutput | None] = [None] * len(groups)
        done = 0
        bar = tqdm(total=len(groups), desc="Generating", disable=not use_tqdm)
        try:
            while done < len(groups):
                for out in self.engine.step():  # deltas: accumulated here
                    i = order.get(out.request_id)
                    if i is None:
                        continue
                    total = results[i]
                    results[i] = out if total is None else total.add(out)
                    if out.finished:
                        done += 1
                        bar.update(1)
        except BaseException:
            for group in groups:  # leave nothing of this call behind on an interrupt
                self.engine.abort_request(group.request_id)
            raise
        finally:
            bar.close()
        return [r for r in results if r is not None]

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> list[RequestOutput]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer, so no chat template", param="messages")
        if not messages:
            raise InvalidRequestError("messages is empty", param="messages")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conversation in conversations:
            _check_messages(conversation)  # type: ignore[arg-type]
            prompts.append(tokenizer.encode_chat(list(conversation), add_generation_prompt))  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _params_for(prompts: list[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
                    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(params)} sampling params for {len(prompts)} prompts",
                                      param="sampling_params")
        return params


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise InvalidRequestError("no prompts given", param="prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _check_messages(messages: Sequence[Message]) -> None:
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidRequestError("each message needs a 'role' (and 'content')", param="messages")
