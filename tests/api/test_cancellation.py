"""A client that goes away cancels its samples in the engine (the fake records that its iterators
were cancelled), and one request's failure never touches another."""
from __future__ import annotations

import asyncio

import openai
import pytest

from cluster.common.errors import OverloadedError
from tests.api.conftest import SERVED_NAME, wait_for
from tests.api.fakes import Script
from tests.api.test_completions import expected_text

try:
    import httpx
except ImportError:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx  # type: ignore[no-redef]

SLOW = Script(delay=0.05)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello", "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
])
def test_disconnect_mid_stream_cancels_every_sample(fake, http, path, body):
    fake.script = lambda request: SLOW
    body = {**body, "model": SERVED_NAME, "max_tokens": 100, "stream": True}
    with http.stream("POST", path, json=body) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(3)]
        assert received[0].startswith("data: {")
    assert wait_for(lambda: len(fake.cancelled) == 2)
    assert fake.cancelled == fake.closed == {q.request_id for q in fake.requests}


def test_openai_client_closing_a_stream_cancels(fake, client):
    fake.script = lambda request: SLOW
    stream = client.completions.create(model=SERVED_NAME, prompt="hello", max_tokens=100, stream=True)
    next(iter(stream))
    stream.close()
    assert wait_for(lambda: len(fake.cancelled) == 1)


def test_disconnect_while_waiting_for_the_first_token_cancels(fake, base_url):
    fake.script = lambda request: Script(hang_after=1)
    for stream in (False, True):
        fake.cancelled.clear()
        with httpx.Client(base_url=base_url, timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "hi", "stream": stream})
        assert wait_for(lambda: len(fake.cancelled) == 1), stream


def test_disconnect_during_a_non_streaming_request_cancels(fake, base_url):
    fake.script = lambda request: SLOW
    with httpx.Client(base_url=base_url, timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": 100, "n": 3})
    assert wait_for(lambda: len(fake.cancelled) == 3)


def test_a_failing_sample_cancels_its_siblings(fake, http):
    fake.script = lambda request: (Script(admission_error=OverloadedError("full"), delay=0.1)
                                   if request.sample_index == 2 else SLOW)
    r = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": 50, "n": 3})
    assert r.status_code == 503
    siblings = {q.request_id for q in fake.requests if q.sample_index != 2}
    assert wait_for(lambda: siblings <= fake.cancelled)


def test_one_requests_failure_does_not_affect_others(fake, async_client):
    def script(request):
        if "fail" in (request.prompt or ""):
            return Script(raise_after=2, delay=0.01)
        if "late" in (request.prompt or ""):
            return Script(deadline_after=3, delay=0.01)
        return Script(delay=0.01)
    fake.script = script

    async def one(prompt: str, stream: bool) -> str:
        if stream:
            chunks = await async_client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=8,
                                                           stream=True)
            return "".join([c.choices[0].text async for c in chunks if c.choices])
        r = await async_client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=8)
        return r.choices[0].text

    async def run():
        async with async_client:
            prompts = [("ok", False), ("fail", False), ("ok", True), ("late", False), ("ok", False),
                       ("fail", True), ("ok", True), ("late", True)] * 2
            return await asyncio.gather(*(one(p, s) for p, s in prompts), return_exceptions=True), prompts

    results, prompts = asyncio.run(run())
    for (prompt, stream), result in zip(prompts, results):
        if prompt == "ok":
            assert result == expected_text(fake, 0, 8)
        elif not stream:
            status = 500 if prompt == "fail" else 504
            assert isinstance(result, openai.APIStatusError) and result.status_code == status
        else:  # the stream started, so the failure arrives as an error event: the client raises
            assert isinstance(result, openai.APIError), result
