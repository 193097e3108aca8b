"""Llama-family models against HF transformers on small random checkpoints: prefill logits (whole
and chunked over a cached prefix), and greedy continuations through the engine with mixed-length
batches, chunked prefill and preemption."""
from __future__ import annotations

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.factories import engine_logits, hf_greedy, make_checkpoint, mixed_prompts

FAMILIES = ["llama", "llama3", "qwen2", "qwen3"]
NEW_TOKENS = 40


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    model = make_checkpoint(path, request.param)
    return path, model


@pytest.mark.parametrize("chunk", [64, 7])
def test_prefill_logits_match_transformers(checkpoint, chunk):
    path, hf = checkpoint
    llm = LLM(path, block_size=4)
    ids = mixed_prompts(300, (50,))[0]
    ours = engine_logits(llm, ids, chunk)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    spread = (ref.max() - ref.min()).item()
    assert (ours - ref).abs().max().item() < 1e-4 * spread
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("setting", ["default", "chunked", "preempting"])
def test_greedy_batch_matches_transformers(checkpoint, setting):
    path, hf = checkpoint
    kwargs = {"default": {}, "chunked": {"max_num_batched_tokens": 8},
              "preempting": {"num_kv_blocks": 48, "max_num_batched_tokens": 32}}[setting]
    llm = LLM(path, block_size=4, **kwargs)
    prompts = mixed_prompts(300)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"
    if setting == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.usage == 0.0  # every block returned
