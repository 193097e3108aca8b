"""Tokenising and chat templating run off the front end's event loop: while a slow prompt is being
tokenised, /health and other requests are answered at once (8 concurrent 3.9 MB prompts froze
every endpoint for 47 s, and /health answered 503). A prompt too long for the context by its
size alone is refused before it is tokenised."""
from __future__ import annotations

import threading
import time

import pytest

from cluster.api.server import build_openai_app
from tests.api.conftest import ServerThread, httpx
from tests.api.fakes import FakeEngineClient

SLOW_S = 1.5


class SlowTokenizer:
    """The real tokenizer, with ``encode`` blocking its thread for ``SLOW_S`` on texts marked slow."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.encoded: list[int] = []
        self.lock = threading.Lock()

    def encode(self, text: str, *args, **kwargs):
        with self.lock:
            self.encoded.append(len(text))
        if text.startswith("slow"):
            time.sleep(SLOW_S)
        return self.inner.encode(text, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.fixture
def slow_server(tokenizer):
    slow = SlowTokenizer(tokenizer)
    fake = FakeEngineClient(slow, model_name="fake-model", max_model_len=128)
    app = build_openai_app(fake, max_body_bytes=8 << 20, served_model_name="fake-model")
    with ServerThread(app) as running:
        yield running, slow


def test_health_and_other_requests_answer_while_a_prompt_is_tokenised(slow_server):
    server, slow = slow_server
    body = {"model": "fake-model", "prompt": "slow hello", "max_tokens": 2}
    done: dict[str, float] = {}

    def long_request() -> None:
        start = time.monotonic()
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
        done["slow"] = time.monotonic() - start
        done["status"] = r.status_code

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.3)  # the slow prompt is in the tokeniser now
    start = time.monotonic()
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    quick = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                       json={"model": "fake-model", "prompt": "hello", "max_tokens": 2})
    answered = time.monotonic() - start
    thread.join()
    assert quick.status_code == 200 and done["status"] == 200
    assert answered < SLOW_S / 2 < done["slow"], (answered, done)


def test_a_prompt_too_long_by_its_size_is_refused_untokenised(slow_server):
    server, slow = slow_server
    text = "x" * (128 * 64 + 1)  # more bytes than 128 tokens of any token in this vocabulary hold
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                   json={"model": "fake-model", "prompt": text, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert len(text) not in slow.encoded  # refused before tokenising
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30,
                      json={"model": "fake-model", "messages": [{"role": "user", "content": text}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
