"""Every error path answers an OpenAI error body with the right status: 400 (bad values, wrong
types, malformed JSON, prompt too long, unknown model, unsupported fields), 413, 429/503 from
admission, 504 from a deadline (or an SSE error event once streaming), 500 without internals."""
from __future__ import annotations

import json

import openai
import pytest

from cluster.api import sample_streams
from cluster.common.errors import EngineDeadError, ErrorKind, InvalidRequestError, OverloadedError, RateLimitedError
from tests.api.conftest import MAX_BODY_BYTES, MODEL_ALIAS, SERVED_NAME
from tests.api.fakes import Script

CHAT = [{"role": "user", "content": "hello"}]


def assert_error(response, status: int, error_type: str, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert error["type"] == error_type and error["param"] == param and isinstance(error["message"], str)
    if code is not None:
        assert error["code"] == code
    assert "Traceback" not in response.text
    return error


def completion(**fields):
    return {"model": SERVED_NAME, "prompt": "hello", **fields}


def chat(**fields):
    return {"model": SERVED_NAME, "messages": CHAT, **fields}


def sse_events(http, path: str, body: dict) -> tuple[int, list[str]]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        return r.status_code, [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_prompt_too_long(fake, http):
    ids = list(range(3, 3 + fake.max_model_len))
    error = assert_error(http.post("/v1/completions", json=completion(prompt=ids)), 400,
                         "invalid_request_error", "prompt", "context_length_exceeded")
    assert str(fake.max_model_len) in error["message"] and "prompt has 128 tokens" in error["message"]
    error = assert_error(http.post("/v1/completions", json=completion(prompt=ids[:100], max_tokens=50)), 400,
                         "invalid_request_error", "max_tokens")
    assert "150 tokens (100 in the prompt, 50 for the completion)" in error["message"]
    long_chat = [{"role": "user", "content": "a b c d e f g h i j " * 20}]
    assert_error(http.post("/v1/chat/completions", json=chat(messages=long_chat)), 400,
                 "invalid_request_error", "messages")
    assert fake.requests == []


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", completion(temperature=-1), "temperature"),
    ("/v1/completions", completion(top_p=0), "top_p"),
    ("/v1/completions", completion(n=0), "n"),
    ("/v1/completions", completion(n=1000), "n"),
    ("/v1/completions", completion(max_tokens=0), "max_tokens"),
    ("/v1/completions", completion(top_k=-5), "top_k"),
    ("/v1/completions", completion(min_p=2), "min_p"),
    ("/v1/completions", completion(presence_penalty=3), "presence_penalty"),
    ("/v1/completions", completion(frequency_penalty=-3), "frequency_penalty"),
    ("/v1/completions", completion(repetition_penalty=0), "repetition_penalty"),
    ("/v1/completions", completion(logprobs=30), "logprobs"),
    ("/v1/completions", completion(min_tokens=5, max_tokens=2), "min_tokens"),
    ("/v1/completions", completion(stop=[""]), "stop"),
    ("/v1/completions", completion(stop_token_ids=[-1]), "stop_token_ids"),
    ("/v1/completions", completion(timeout=-1), "timeout"),
    ("/v1/completions", completion(prompt=[5, 100000]), "prompt"),
    ("/v1/completions", completion(prompt=""), "prompt"),
    ("/v1/completions", completion(echo=True), "echo"),
    ("/v1/completions", completion(best_of=3), "best_of"),
    ("/v1/completions", completion(logit_bias={"5": 1.0}), "logit_bias"),
    ("/v1/completions", completion(stream_options={"include_usage": True}), "stream_options"),
    ("/v1/chat/completions", chat(temperature=-1), "temperature"),
    ("/v1/chat/completions", chat(max_tokens=0), "max_tokens"),
    ("/v1/chat/completions", chat(max_completion_tokens=0), "max_completion_tokens"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=25), "top_logprobs"),
    ("/v1/chat/completions", chat(top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", chat(tools=[{"type": "function"}]), "tools"),
    ("/v1/chat/completions", chat(response_format={"type": "json_object"}), "response_format"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
])
def test_bad_values_are_400(fake, http, path, body, param):
    assert_error(http.post(path, json=body), 400, "invalid_request_error", param)
    assert fake.requests == []


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", completion(temperature="hot"), "temperature"),
    ("/v1/completions", completion(n=1.5), "n"),
    ("/v1/completions", completion(max_tokens="10"), "max_tokens"),
    ("/v1/completions", completion(stream="yes"), "stream"),
    ("/v1/completions", completion(stop=5), "stop"),
    ("/v1/completions", completion(prompt=5), "prompt"),
    ("/v1/completions", completion(prompt=[]), "prompt"),
    ("/v1/completions", completion(prompt=[[1, "a"]]), "prompt"),
    ("/v1/completions", completion(model=None), "model"),
    ("/v1/completions", {"prompt": "hello"}, "model"),
    ("/v1/chat/completions", chat(messages="hello"), "messages"),
    ("/v1/chat/completions", chat(messages=[]), "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), "messages"),
    ("/v1/chat/completions", {"model": SERVED_NAME}, "messages"),
])
def test_wrong_types_are_400_not_422(fake, http, path, body, param):
    error = assert_error(http.post(path, json=body), 400, "invalid_request_error", param)
    assert param in error["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", completion(model="nope")),
    ("/v1/chat/completions", chat(model="nope")),
])
def test_unknown_model(fake, http, path, body):
    error = assert_error(http.post(path, json=body), 404, "invalid_request_error", "model", "model_not_found")
    assert "nope" in error["message"]


def test_unknown_model_through_the_openai_client(fake, client):
    """As OpenAI answers: 404 model_not_found (the client raises NotFoundError)."""
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="hi")
    assert info.value.status_code == 404 and info.value.code == "model_not_found" and info.value.param == "model"


def test_retrieve_a_model(fake, client, http):
    """GET /v1/models/{id}: the served model's card, by its name or an alias; 404 for others."""
    assert client.models.retrieve("test-model").id == "test-model"
    assert http.get("/v1/models/models/fake-model").json()["id"] == "test-model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


@pytest.mark.parametrize("raw,message", [
    (b"{bad json", "malformed JSON"),
    (b'{"model": "test-model", "prompt": "hi"', "malformed JSON"),
    (b"", "malformed JSON"),
    (b"[1, 2]", "JSON object"),
    (b'"text"', "JSON object"),
])
def test_malformed_json_is_400(fake, http, raw, message):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert message in assert_error(r, 400, "invalid_request_error")["message"]


def test_oversize_body_is_413_by_header_and_by_bytes(fake, http):
    big = json.dumps(completion(prompt="a" * MAX_BODY_BYTES)).encode()
    assert_error(http.post("/v1/completions", content=big), 413, "invalid_request_error", code="request_too_large")

    def chunked():  # no Content-Length: the limit must hold on the bytes read
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]
    r = http.post("/v1/chat/completions", content=chunked())
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "invalid_request_error", code="request_too_large")
    assert fake.requests == []


@pytest.mark.parametrize("exc,status,error_type", [
    (OverloadedError("all queues are full"), 503, "overloaded_error"),
    (RateLimitedError("slow down"), 429, "rate_limit_error"),
    (EngineDeadError("engine is dead"), 503, "engine_dead_error"),
    (InvalidRequestError("decode says no", param="prompt"), 400, "invalid_request_error"),
])
def test_admission_errors_keep_their_status(fake, http, exc, status, error_type):
    fake.script = lambda request: Script(admission_error=exc)
    error = assert_error(http.post("/v1/completions", json=completion()), status, error_type, exc.param)
    assert error["message"] == exc.message
    status_code, events = sse_events(http, "/v1/chat/completions", chat())
    assert status_code == status  # a stream answers the status before sending anything


def test_overload_through_the_openai_client(fake, client):
    fake.script = lambda request: Script(admission_error=RateLimitedError("slow down"))
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=SERVED_NAME, messages=CHAT)
    assert info.value.status_code == 429
    fake.script = lambda request: Script(admission_error=OverloadedError("full"))
    with pytest.raises(openai.InternalServerError) as info:
        list(client.completions.create(model=SERVED_NAME, prompt="hi", stream=True))
    assert info.value.status_code == 503


def test_deadline_before_any_output_is_504(fake, http):
    fake.script = lambda request: Script(deadline_after=1)
    assert_error(http.post("/v1/completions", json=completion(timeout=1)), 504, "timeout_error",
                 code="deadline_exceeded")
    status, _ = sse_events(http, "/v1/chat/completions", chat(timeout=1))
    assert status == 504


def test_deadline_mid_stream_is_an_error_event(fake, http):
    fake.script = lambda request: Script(deadline_after=4)
    status, events = sse_events(http, "/v1/completions", completion(max_tokens=10))
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "timeout_error" and "deadline" in error["message"]
    assert len(events) == 5  # three token chunks, the error, [DONE]
    # Not streaming, the whole request fails.
    assert_error(http.post("/v1/completions", json=completion(max_tokens=10)), 504, "timeout_error")


def test_an_engine_that_never_answers_is_cut_at_the_deadline(fake, http, monkeypatch):
    monkeypatch.setattr(sample_streams, "DEADLINE_GRACE_S", 0.05)
    fake.script = lambda request: Script(hang_after=1)
    assert_error(http.post("/v1/completions", json=completion(timeout=0.2)), 504, "timeout_error")
    assert [q.request_id for q in fake.requests] == sorted(fake.cancelled)


def test_internal_errors_are_500_without_details(fake, http):
    fake.script = lambda request: Script(raise_after=1)
    r = http.post("/v1/completions", json=completion())
    error = assert_error(r, 500, "internal_error")
    assert error["message"] == "Internal server error" and "boom" not in r.text
    fake.script = lambda request: Script(raise_after=3)
    status, events = sse_events(http, "/v1/chat/completions", chat())
    assert status == 200 and events[-1] == "[DONE]" and "boom" not in "".join(events)
    assert json.loads(events[-2])["error"]["type"] == "internal_error"


def test_typed_error_outputs_map_to_their_class(fake, http):
    fake.script = lambda request: Script(error_after=1, error_kind=ErrorKind.KV_TRANSFER)
    error = assert_error(http.post("/v1/completions", json=completion()), 500, "kv_transfer_error")
    assert "KV transfer failed" in error["message"]
    fake.script = lambda request: Script(error_after=2, error_kind=ErrorKind.ENGINE_DEAD)
    status, events = sse_events(http, "/v1/completions", completion())
    assert status == 200 and json.loads(events[-2])["error"]["type"] == "engine_dead_error"


def test_unknown_routes_and_methods_use_the_error_body(fake, http):
    assert_error(http.get("/v1/nothing"), 404, "not_found_error")
    assert_error(http.get("/v1/completions"), 405, "invalid_request_error")


def test_the_model_setting_is_accepted_as_an_alias(fake, http):
    """Clients may name the model as the server's ``model`` setting gave it (``smollm2``, a
    path); answers carry the served name."""
    resp = http.post("/v1/completions", json=completion(model=MODEL_ALIAS))
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == SERVED_NAME
