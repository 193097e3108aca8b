"""/v1/completions through the official openai client (sync and async, streaming and not): every
request field reaching the engine, prompt forms, n, streaming deltas, usage, logprobs."""
from __future__ import annotations

import asyncio
import json

import pytest

from cluster.common.block_hash import hash_token_blocks
from tests.api.conftest import SERVED_NAME
from tests.api.fakes import Script


def expected_text(fake, sample_index: int, num_tokens: int) -> str:
    ids = fake.reply_ids[sample_index:] + fake.reply_ids[:sample_index]
    return fake.tokenizer.decode((ids * 10)[:num_tokens])


def test_completion_text_usage_and_shape(fake, client, tokenizer):
    r = client.completions.create(model=SERVED_NAME, prompt="hello world", max_tokens=8)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == SERVED_NAME
    [choice] = r.choices
    assert choice.index == 0 and choice.text == expected_text(fake, 0, 8)
    assert choice.finish_reason == "length" and choice.logprobs is None
    prompt_len = len(tokenizer.encode("hello world"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt_len, 8, prompt_len + 8)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    [request] = fake.requests
    assert request.prompt == "hello world" and request.prompt_token_ids == tokenizer.encode("hello world")


def test_every_sampling_field_reaches_the_engine(fake, client):
    client.completions.create(
        model=SERVED_NAME, prompt="hello", max_tokens=7, temperature=0.5, top_p=0.9, seed=1234,
        presence_penalty=0.5, frequency_penalty=-0.5, stop=["zz", "yy"], user="someone",
        extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True, "min_tokens": 2, "repetition_penalty": 1.1,
                    "stop_token_ids": [7, 8], "skip_special_tokens": False, "timeout": 30})
    p = fake.requests[0].sampling_params
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.seed) == (1, 7, 0.5, 0.9, 1234)
    assert (p.presence_penalty, p.frequency_penalty, p.stop) == (0.5, -0.5, ("zz", "yy"))
    assert (p.top_k, p.min_p, p.ignore_eos, p.min_tokens, p.repetition_penalty) == (5, 0.1, True, 2, 1.1)
    assert (p.stop_token_ids, p.skip_special_tokens, p.deadline_s, p.logprobs) == ((7, 8), False, 30, None)


def test_defaults_and_single_stop_string(fake, client):
    client.completions.create(model=SERVED_NAME, prompt="hello", stop="zz")
    p = fake.requests[0].sampling_params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop, p.deadline_s) == (16, 1.0, 1.0, -1, ("zz",), None)


def test_max_tokens_null_fills_the_context(fake, http, tokenizer):
    r = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "hello", "max_tokens": None})
    assert r.status_code == 200
    assert fake.requests[0].sampling_params.max_tokens == fake.max_model_len - len(tokenizer.encode("hello"))


@pytest.mark.parametrize("prompt,expected", [
    ("hello world", ["hello world"]),
    (["hello", "the fox"], ["hello", "the fox"]),
    ([5, 6, 7, 8], [[5, 6, 7, 8]]),
    ([[5, 6], [9, 10, 11]], [[5, 6], [9, 10, 11]]),
])
def test_prompt_forms(fake, client, tokenizer, prompt, expected):
    r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=3)
    ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in expected]
    assert [c.index for c in r.choices] == list(range(len(expected)))
    assert [req.prompt_token_ids for req in fake.requests] == ids
    assert r.usage.prompt_tokens == sum(len(i) for i in ids)
    assert r.usage.completion_tokens == 3 * len(expected)


def test_n_and_prompt_lists_fan_out_as_samples(fake, client, tokenizer):
    long_prompt = "the quick brown fox jumps over the lazy dog " * 2
    r = client.completions.create(model=SERVED_NAME, prompt=[long_prompt, "hello"], n=3, max_tokens=4, seed=7)
    assert len(r.choices) == 6 and [c.index for c in r.choices] == list(range(6))
    requests = sorted(fake.requests, key=lambda q: q.request_id)
    assert len({q.request_id for q in requests}) == 6
    assert sorted((q.prompt, q.sample_index) for q in requests) == sorted(
        (p, s) for p in (long_prompt, "hello") for s in range(3))
    for q in requests:
        assert q.sampling_params.n == 1 and q.sampling_params.seed == 7
        assert q.block_hashes == hash_token_blocks(q.prompt_token_ids, 16)
    assert len(next(q for q in requests if q.prompt == long_prompt).block_hashes) >= 1
    assert len({q.arrival_time for q in requests}) == 1
    for c in r.choices:  # choice i is sample i % n of prompt i // n
        assert c.text == expected_text(fake, c.index % 3, 4)
    assert r.usage.prompt_tokens == len(tokenizer.encode(long_prompt)) + len(tokenizer.encode("hello"))
    assert r.usage.completion_tokens == 24


@pytest.mark.parametrize("script", [Script(), Script(tokens_per_step=3), Script(eos_after=5)])
def test_stream_deltas_concatenate_to_the_full_text(fake, client, script):
    fake.script = lambda request: script
    kwargs = dict(model=SERVED_NAME, prompt=["hello", "fox"], n=2, max_tokens=12, stop=["lazy"])
    full = client.completions.create(**kwargs)
    texts, finish = {}, {}
    for chunk in client.completions.create(stream=True, **kwargs):
        assert chunk.usage is None
        for c in chunk.choices:
            assert c.index not in finish, "no chunk after a choice's finish_reason"
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}


def test_stop_string_cuts_the_text(fake, client):
    r = client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=40, stop=["fox"])
    [c] = r.choices
    assert c.text == " the quick brown " and c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == "fox"


def test_eos_finishes_with_stop(fake, client):
    fake.script = lambda request: Script(eos_after=3)
    [c] = client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=10).choices
    assert c.finish_reason == "stop" and c.text == expected_text(fake, 0, 3)


def test_include_usage_sends_a_final_usage_chunk(fake, client, tokenizer):
    fake.script = lambda request: Script(num_cached_tokens=16)
    chunks = list(client.completions.create(model=SERVED_NAME, prompt="hello", max_tokens=5, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    *body, last = chunks
    assert all(c.usage is None for c in body) and last.choices == []
    prompt_len = len(tokenizer.encode("hello"))
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_len, 10)
    assert last.usage.total_tokens == prompt_len + 10
    assert last.usage.prompt_tokens_details.cached_tokens == 16


def test_sse_framing_ends_with_done(fake, http):
    body = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(fake, 0, 3)
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["object"] == "text_completion"


def test_cached_tokens_sum_over_prompts(fake, client):
    fake.script = lambda request: Script(num_cached_tokens=32 if request.prompt == "hello there" else 0)
    r = client.completions.create(model=SERVED_NAME, prompt=["hello there", "hello there", "fox"], max_tokens=2, n=2)
    assert r.usage.prompt_tokens_details.cached_tokens == 64


def test_completion_logprobs_shape(fake, client):
    r = client.completions.create(model=SERVED_NAME, prompt="hello", max_tokens=6, logprobs=2)
    [c] = r.choices
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert lp.token_logprobs == [-0.25] * 6
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert len(top) <= 2 and top[token] == -0.25
    assert fake.requests[0].sampling_params.logprobs == 2


def test_completion_logprobs_zero_gives_the_sampled_token(fake, client):
    [c] = client.completions.create(model=SERVED_NAME, prompt="hello", max_tokens=3, logprobs=0).choices
    assert [list(top.values()) for top in c.logprobs.top_logprobs] == [[-0.25]] * 3


def test_streamed_logprobs_continue_offsets(fake, client):
    kwargs = dict(model=SERVED_NAME, prompt="hello", max_tokens=6, logprobs=1)
    full = client.completions.create(**kwargs).choices[0].logprobs
    tokens, offsets = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert tokens == full.tokens and offsets == full.text_offset


def test_async_client_streaming_and_not(fake, async_client):
    async def run():
        async with async_client:
            full = await async_client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=5)
            stream = await async_client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=5, stream=True)
            text = "".join([c.choices[0].text async for c in stream if c.choices])
            return full.choices[0].text, text
    full, streamed = asyncio.run(run())
    assert full == streamed == expected_text(fake, 0, 5)
