"""``return_timings``: each choice says where its time went (the front end's preparation, TTFT and
e2e, and the workers' TTFT breakdown), in whole responses and in a choice's last stream chunk,
through the official openai client; without the flag no body carries the field."""
from __future__ import annotations

import asyncio

import pytest

from tests.api.conftest import SERVED_NAME
from tests.api.fakes import Script

PARTS = {"prefill_queue": 0.01, "prefill_compute": 0.02, "transfer": 0.003, "first_decode": 0.004,
         "queue": 0.01, "ttft": 0.05}
FORKED = {"ttft": 0.03}
#: Seconds the fake waits before each output: TTFT at least one, e2e at least four of them.
DELAY = 0.02


def check(timings: dict[str, float], tokens: int, first_sample: bool) -> None:
    assert 0.0 <= timings["prepare"] <= timings["ttft"] <= timings["e2e"]
    assert timings["ttft"] >= DELAY * 0.9 and timings["e2e"] >= tokens * DELAY * 0.9
    assert timings["e2e"] < 10.0
    if first_sample:  # the workers' breakdown rides on a prompt's first sample's first output
        assert {k: timings[k] for k in PARTS if k != "ttft"} == {k: v for k, v in PARTS.items() if k != "ttft"}
        assert timings["worker_ttft"] == PARTS["ttft"]
    else:  # a forked sample: the decode worker reports only its own TTFT
        assert not (set(PARTS) - {"ttft"}) & set(timings) and timings["worker_ttft"] == FORKED["ttft"]


@pytest.fixture
def timed(fake):
    fake.script = lambda request: Script(delay=DELAY, timings=dict(PARTS if request.sample_index == 0 else FORKED))
    return fake


def test_whole_responses_carry_each_choices_timings(timed, client):
    resp = client.completions.create(model=SERVED_NAME, prompt=["hello", "the quick"], n=2, max_tokens=4,
                                     extra_body={"return_timings": True})
    assert len(resp.choices) == 4
    for choice in resp.choices:
        check(choice.model_extra["timings"], 4, first_sample=choice.index % 2 == 0)
    chat = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, extra_body={"return_timings": True})
    check(chat.choices[0].model_extra["timings"], 3, first_sample=True)


def test_a_streamed_choice_carries_its_timings_in_its_last_chunk(timed, client):
    seen: dict[int, list[dict | None]] = {}
    for chunk in client.completions.create(model=SERVED_NAME, prompt="hello", n=2, max_tokens=4, stream=True,
                                           extra_body={"return_timings": True}):
        for c in chunk.choices:
            seen.setdefault(c.index, []).append((c.finish_reason, (c.model_extra or {}).get("timings")))
    assert sorted(seen) == [0, 1]
    for index, chunks in seen.items():
        *body, (reason, timings) = chunks
        assert reason == "length" and all(t is None for _, t in body)
        check(timings, 4, first_sample=index == 0)
    chat_last = None
    for chunk in client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, stream=True, extra_body={"return_timings": True}):
        for c in chunk.choices:
            chat_last = (c.finish_reason, (c.model_extra or {}).get("timings"))
    assert chat_last is not None and chat_last[0] == "length"
    check(chat_last[1], 3, first_sample=True)


def test_no_timings_unless_asked(timed, client, http):
    resp = client.completions.create(model=SERVED_NAME, prompt="hello", max_tokens=2)
    assert "timings" not in (resp.choices[0].model_extra or {})
    body = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "hello", "max_tokens": 2}).text
    assert "timings" not in body
    streamed = http.post("/v1/chat/completions", json={"model": SERVED_NAME, "max_tokens": 2, "stream": True,
                                                       "messages": [{"role": "user", "content": "hi"}]}).text
    assert "timings" not in streamed and streamed.rstrip().endswith("data: [DONE]")
    r = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "hello", "return_timings": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_timings"


def test_concurrent_requests_time_their_own_choices(timed, async_client):
    """Choices of requests that ran side by side: each one's e2e is its own, not its neighbour's."""
    async def one(tokens: int):
        resp = await async_client.completions.create(model=SERVED_NAME, prompt="hello", max_tokens=tokens,
                                                     extra_body={"return_timings": True})
        return resp.choices[0].model_extra["timings"]

    async def both():
        try:
            return await asyncio.gather(one(2), one(8))
        finally:
            await async_client.close()
    short, long = asyncio.run(both())
    check(short, 2, True)
    check(long, 8, True)
    assert long["e2e"] > short["e2e"] + 4 * DELAY
