"""``n > 1`` and prompt lists through the real Ray Serve application (disaggregated: one prefill and
one decode replica), with the official openai client: completions and chats, streamed and not,
each answered within seconds and equal to offline ``LLM.generate`` for greedy and seeded
sampling; one routed call and one prefill per prompt whatever ``n`` is (the prefill draws every
sample's first token; the other samples fork sample 0's KV on the decode replica). Before each routed call got its own internal request id,
the second of two calls made under one request was never routed
(``tests/router/test_serve_routing.py``): ``n=2`` took 31 s or failed."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from cluster import LLM, SamplingParams
from tests.e2e.test_disaggregation import model_name
from tests.factories import mixed_prompts

pytestmark = pytest.mark.e2e
MAX_TOKENS = 8
#: Seconds one request may take here (2 CPU cores, a tiny model): the hang took 31-55 s.
WITHIN_S = 15.0
PROMPTS = mixed_prompts(300, (5, 21, 40), seed=31)
MESSAGES = [{"role": "user", "content": "hello world, this is a small test"}]
SEEDED = dict(temperature=0.9, top_p=0.95, seed=77)


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model_dir, block_size=16)

    def run(prompts, n, **sampling):
        params = SamplingParams(n=n, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]

    def chat(n, **sampling):
        params = SamplingParams(n=n, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
        return [c.text for c in llm.chat(MESSAGES, params)[0].outputs]
    return run, chat


@pytest.fixture(scope="module")
def served(cluster, model_dir):
    cluster.deploy({"model": model_dir, "kv_transfer": "ipc"})
    return cluster


def _client(served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0, timeout=60)


async def _timed(coro):
    start = time.monotonic()
    result = await coro
    elapsed = time.monotonic() - start
    assert elapsed < WITHIN_S, f"took {elapsed:.1f} s"
    return result


def _ids(choice) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in choice.logprobs.tokens]


async def _completions(served, model, prompts, n, stream, **sampling):
    """Per prompt, per sample: the generated token ids (choice ``p * n + s``)."""
    client = _client(served)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    try:
        if not stream:
            resp = await _timed(client.completions.create(model=model, prompt=prompts, n=n, max_tokens=MAX_TOKENS,
                                                          logprobs=0, extra_body=extra, **sampling))
            choices = sorted(resp.choices, key=lambda c: c.index)
            assert all(c.finish_reason == "length" for c in choices)
            flat = [_ids(c) for c in choices]
        else:
            async def collect():
                got: dict[int, list[int]] = {}
                finished = set()
                async for chunk in await client.completions.create(
                        model=model, prompt=prompts, n=n, max_tokens=MAX_TOKENS, logprobs=0, stream=True,
                        extra_body=extra, **sampling):
                    for c in chunk.choices:
                        got.setdefault(c.index, []).extend(_ids(c) if c.logprobs else [])
                        if c.finish_reason:
                            finished.add(c.index)
                assert finished == set(range(len(prompts) * n))  # every choice ended, then [DONE]
                return [got[i] for i in range(len(prompts) * n)]
            flat = await _timed(collect())
        return [flat[p * n:(p + 1) * n] for p in range(len(prompts))]
    finally:
        await client.close()


async def _chats(served, model, n, stream, **sampling) -> list[str]:
    client = _client(served)
    try:
        if not stream:
            resp = await _timed(client.chat.completions.create(model=model, messages=MESSAGES, n=n,
                                                               max_tokens=MAX_TOKENS,
                                                               extra_body={"ignore_eos": True}, **sampling))
            return [c.message.content for c in sorted(resp.choices, key=lambda c: c.index)]

        async def collect():
            texts: dict[int, str] = {}
            async for chunk in await client.chat.completions.create(
                    model=model, messages=MESSAGES, n=n, max_tokens=MAX_TOKENS, stream=True,
                    extra_body={"ignore_eos": True}, **sampling):
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            return [texts[i] for i in range(n)]
        return await _timed(collect())
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("n", [2, 4])
def test_n_samples_and_prompt_lists_equal_offline(served, model_dir, offline, n, stream):
    run, _ = offline
    model = model_name(model_dir)
    greedy = asyncio.run(_completions(served, model, PROMPTS, n, stream, temperature=0.0))
    assert greedy == run(PROMPTS, n, temperature=0.0)
    assert all(len({tuple(s) for s in samples}) == 1 for samples in greedy)  # greedy samples agree
    seeded = asyncio.run(_completions(served, model, PROMPTS, n, stream, **SEEDED))
    assert seeded == run(PROMPTS, n, **SEEDED)
    single = asyncio.run(_completions(served, model, PROMPTS[:1], n, stream, **SEEDED))
    assert single == seeded[:1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_with_n_samples_equals_offline(served, model_dir, offline, stream):
    _, chat = offline
    model = model_name(model_dir)
    assert asyncio.run(_chats(served, model, 2, stream, temperature=0.0)) == chat(2, temperature=0.0)
    assert asyncio.run(_chats(served, model, 4, stream, **SEEDED)) == chat(4, **SEEDED)


def test_one_prefill_per_prompt_whatever_n(served, model_dir, offline):
    """A list of 3 prompts with n=4: the prefill replica computes 3 prompts (not 12), and the
    decode replica forks samples 1..3 of each from sample 0's KV (9 forks)."""
    run, _ = offline
    model = model_name(model_dir)
    prompts = mixed_prompts(300, (40, 70, 100), seed=32)  # 2, 4 and 6 full blocks of 16 tokens

    def prefills() -> float:
        return sum(served.metric("cluster:prefill_requests_total", role="prefill"))
    before = served.wait_for_metric("cluster:prefill_requests_total", lambda v: bool(v), role="prefill")
    assert before, "the prefill replica reports no prefill_requests_total"
    time.sleep(1.2)  # the reports of the earlier tests' requests are in
    before_total = prefills()
    forks_before = sum(served.metric("cluster:forked_samples_total", role="decode"))
    assert asyncio.run(_completions(served, model, prompts, 4, False, **SEEDED)) == run(prompts, 4, **SEEDED)
    after = served.wait_for_metric("cluster:prefill_requests_total",
                                   lambda v: sum(v) >= before_total + 3, role="prefill")
    forks = served.wait_for_metric("cluster:forked_samples_total",
                                   lambda v: sum(v) >= forks_before + 9, role="decode")
    time.sleep(1.2)
    assert sum(after) == before_total + 3 == prefills()
    assert sum(forks) == forks_before + 9 == sum(served.metric("cluster:forked_samples_total", role="decode"))


def test_many_multi_sample_requests_at_once(served, model_dir, offline):
    """Concurrent requests of several samples each: every sample of every request routed and
    answered, none lost, KV back to empty, no request left in any lifecycle state."""
    run, _ = offline
    model = model_name(model_dir)

    async def many():
        return await asyncio.gather(*(_completions(served, model, PROMPTS[:2], 2, i % 2 == 1, **SEEDED)
                                      for i in range(6)))
    want = run(PROMPTS[:2], 2, **SEEDED)
    assert asyncio.run(many()) == [want] * 6
    usage = served.wait_for_metric("cluster:kv_cache_usage_perc", lambda v: v and max(v) == 0.0, role="decode")
    assert usage and max(usage) == 0.0
    # the roles' lifecycle gauges are served, one per state, and drain to zero
    for state in ("waiting_for_blocks", "remote_prefill", "receiving", "local_prefill", "decoding", "failed",
                  "overdue"):
        values = served.wait_for_metric(f"cluster:decode_requests_{state}", lambda v: v and max(v) == 0.0,
                                        role="decode")
        assert values and max(values) == 0.0, state
    for state in ("queued", "prefilling", "sending", "sent", "failed", "overdue"):
        values = served.wait_for_metric(f"cluster:prefill_requests_{state}", lambda v: v and max(v) == 0.0,
                                        role="prefill")
        assert values and max(values) == 0.0, state


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_choices_say_where_their_time_went(served, model_dir, stream):
    """``return_timings`` through the served app, for a prompt list with ``n=2``: every choice has
    the front end's ``prepare``, ``ttft`` and ``e2e``; a prompt's first sample, prefilled by the
    prefill replica, the workers' breakdown (its queue, compute, KV transfer and first decode
    step, all within its TTFT); the forked sample its decode worker's TTFT. The tokens are those
    of a request without the flag."""
    model = model_name(model_dir)

    async def ask(extra):
        client = _client(served)
        try:
            if not stream:
                resp = await _timed(client.completions.create(model=model, prompt=PROMPTS[:2], n=2, seed=77,
                                                              max_tokens=MAX_TOKENS, temperature=0.9,
                                                              extra_body=extra))
                return {c.index: (c.text, (c.model_extra or {}).get("timings")) for c in resp.choices}
            got: dict[int, tuple[str, dict | None]] = {}
            async for chunk in await client.completions.create(model=model, prompt=PROMPTS[:2], n=2, seed=77,
                                                                 max_tokens=MAX_TOKENS, temperature=0.9,
                                                                 stream=True, extra_body=extra):
                for c in chunk.choices:
                    text, _ = got.get(c.index, ("", None))
                    got[c.index] = (text + c.text, (c.model_extra or {}).get("timings"))
            return got
        finally:
            await client.close()
    got = asyncio.run(ask({"ignore_eos": True, "return_timings": True}))
    assert sorted(got) == [0, 1, 2, 3]
    plain = asyncio.run(ask({"ignore_eos": True}))
    assert {i: text for i, (text, _) in got.items()} == {i: text for i, (text, _) in plain.items()}
    assert all(t is None for _, t in plain.values())
    for index, (_, t) in got.items():
        assert t is not None, f"choice {index} carries no timings"
        assert 0.0 <= t["prepare"] <= t["ttft"] <= t["e2e"] < WITHIN_S
        assert 0.0 < t["worker_ttft"] <= t["ttft"]
        if index % 2 == 0:  # sample 0 of its prompt: computed on the prefill replica
            assert {"queue", "prefill_queue", "prefill_compute", "transfer", "first_decode"} <= set(t)
            assert t["queue"] == t["prefill_queue"] and t["prefill_compute"] > 0.0
            assert t["prefill_queue"] + t["prefill_compute"] + t["transfer"] + t["first_decode"] <= t["ttft"]
        else:  # forked from sample 0's KV on the decode replica
            assert "prefill_compute" not in t
    assert sum(len(text) for text, _ in got.values()) > 0
    assert len({text for text, _ in got.values()}) > 1  # seeded samples differ
