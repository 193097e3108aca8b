"""/v1/chat/completions through the official openai client: the chat template, content parts,
streaming deltas (the role first), max_completion_tokens, logprobs and top_logprobs."""
from __future__ import annotations

import asyncio

from tests.api.conftest import SERVED_NAME
from tests.api.fakes import Script
from tests.api.test_completions import expected_text

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def test_chat_applies_the_template(fake, client, tokenizer):
    r = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=6)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == SERVED_NAME
    [c] = r.choices
    assert c.message.role == "assistant" and c.message.content == expected_text(fake, 0, 6)
    assert c.finish_reason == "length"
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    [request] = fake.requests
    assert request.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(request.prompt_token_ids) and r.usage.completion_tokens == 6


def test_content_parts_are_joined(fake, client, tokenizer):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": parts}], max_tokens=2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hello\nworld"}])
    assert fake.requests[0].prompt == text


def test_max_completion_tokens_wins_and_default_fills_the_context(fake, client):
    client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=9, max_completion_tokens=4)
    client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES)
    first, second = fake.requests
    assert first.sampling_params.max_tokens == 4
    assert second.sampling_params.max_tokens == fake.max_model_len - len(second.prompt_token_ids)


def test_chat_stream_role_first_and_deltas_concatenate(fake, client):
    kwargs = dict(model=SERVED_NAME, messages=MESSAGES, max_tokens=10, n=2, seed=3)
    full = client.chat.completions.create(**kwargs)
    roles, texts, finish = {}, {}, {}
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk" and chunk.usage is None
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {0: "length", 1: "length"}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 20
    assert usage.total_tokens == usage.prompt_tokens + 20


def test_only_the_first_chunk_of_a_choice_carries_the_role(fake, client):
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=4, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])


def test_chat_logprobs_with_top_logprobs(fake, client):
    r = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=5, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob == -0.25 and bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert [x.logprob for x in t.top_logprobs] == [-0.25, -2.0, -3.0]
        assert all(isinstance(x.bytes, list) for x in t.top_logprobs)
    assert fake.requests[0].sampling_params.logprobs == 3


def test_chat_logprobs_without_top(fake, client):
    r = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=3, logprobs=True)
    assert [t.top_logprobs for t in r.choices[0].logprobs.content] == [[], [], []]
    assert fake.requests[0].sampling_params.logprobs == 0
    plain = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=3)
    assert plain.choices[0].logprobs is None and fake.requests[1].sampling_params.logprobs is None


def test_chat_streamed_logprobs_match(fake, client):
    kwargs = dict(model=SERVED_NAME, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=2)
    full = [t.token for t in client.chat.completions.create(**kwargs).choices[0].logprobs.content]
    fake.script = lambda request: Script(tokens_per_step=2)
    streamed = [t.token for chunk in client.chat.completions.create(stream=True, **kwargs)
                for c in chunk.choices if c.logprobs for t in c.logprobs.content]
    assert streamed == full


def test_async_chat_stream(fake, async_client):
    async def run():
        async with async_client:
            stream = await async_client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES,
                                                                max_tokens=5, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert asyncio.run(run()) == expected_text(fake, 0, 5)
