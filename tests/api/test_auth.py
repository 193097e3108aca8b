"""API keys and CORS: with ``api_key`` set (several keys, comma-separated; env ``CLUSTER_API_KEY``)
every ``/v1/*`` request needs ``Authorization: Bearer <key>`` (401 with an OpenAI error body
otherwise, which the openai client raises as AuthenticationError); ``/health`` and ``/metrics``
stay open; ``cors_allow_origins`` answers preflights for the allowed origins only."""
from __future__ import annotations

import openai
import pytest

from cluster.api.server import build_openai_app
from cluster.config import parse_cluster_args
from tests.api.conftest import ServerThread, httpx
from tests.api.fakes import FakeEngineClient


@pytest.fixture
def keyed(tokenizer):
    fake = FakeEngineClient(tokenizer, model_name="fake-model")
    app = build_openai_app(fake, max_body_bytes=1 << 20, served_model_name="fake-model",
                           api_keys="key-one, key-two", cors_allow_origins="https://app.example")
    with ServerThread(app) as running:
        yield running.base_url


def test_v1_needs_one_of_the_keys(keyed):
    for key in ("key-one", "key-two"):
        client = openai.OpenAI(base_url=f"{keyed}/v1", api_key=key, max_retries=0)
        assert client.models.list().data[0].id == "fake-model"
        out = client.completions.create(model="fake-model", prompt="hello", max_tokens=2)
        assert out.choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed}/v1", api_key="wrong", max_retries=0).models.list()
    for headers in ({}, {"Authorization": "key-one"}, {"Authorization": "Bearer key-on"}):
        r = httpx.post(f"{keyed}/v1/completions", headers=headers, timeout=10,
                       json={"model": "fake-model", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed}/health", timeout=10).status_code == 200
    assert httpx.get(f"{keyed}/metrics", timeout=10).status_code == 200


def test_cors_allows_the_configured_origin_only(keyed):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(f"{keyed}/v1/chat/completions", headers={"Origin": "https://app.example", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(f"{keyed}/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers


def test_keys_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("CLUSTER_API_KEY", "env-key,second")
    assert parse_cluster_args({}).api_key == "env-key,second"
