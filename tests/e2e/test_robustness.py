"""Through the real Ray Serve application: nothing is lost or leaked under disconnects and
deadlines, an injected transfer failure fails or re-prefills only its request, bad input gets the
right status and error body without hurting a replica, overload is refused, and the metrics are
exposed with their role labels."""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from ray import serve

from cluster import LLM, SamplingParams
from tests.e2e.conftest import httpx

pytestmark = pytest.mark.e2e


def settings(model_dir: str, **extra) -> dict:
    return {"model": model_dir, "kv_transfer": "ipc", "remote_kv_grace_s": 0.5, **extra}


def complete(cluster, model: str, prompt, **fields) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(f"{cluster.base_url}/v1/completions", json=body, timeout=60)


def name_of(model_dir: str) -> str:
    return model_dir.rstrip("/").rsplit("/", 1)[-1]


def wait_until_idle(cluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        usage = [cluster.metric("cluster:kv_cache_usage_perc", role=r) for r in ("prefill", "decode")]
        running = cluster.metric("cluster:num_requests_running")
        if all(u and max(u) == 0.0 for u in usage) and not any(running):
            return
        time.sleep(0.5)
    raise AssertionError(f"KV blocks still in use: {usage}, running {running}")


async def one_stream(client: httpx.AsyncClient, url: str, body: dict, mode: str) -> str:
    try:
        async with client.stream("POST", url, json=body, timeout=60) as resp:
            if mode == "before-first":
                return "disconnected"
            async for line in resp.aiter_lines():
                if line.startswith("data:") and mode == "after-first":
                    return "disconnected"
                if line == "data: [DONE]":
                    return f"done-{resp.status_code}"
            return f"status-{resp.status_code}"
    except httpx.ReadTimeout:
        return "timeout"


def test_nothing_leaks_after_disconnects_and_deadlines(cluster, model_dir):
    cluster.deploy(settings(model_dir))
    rng = random.Random(5)
    url = f"{cluster.base_url}/v1/completions"
    jobs = []
    for i in range(50):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(5, 120))]
        body = {"model": name_of(model_dir), "prompt": prompt, "max_tokens": rng.randrange(20, 60),
                "temperature": 0.7, "ignore_eos": True, "stream": True}
        mode = ["complete", "before-first", "after-first"][i % 3]
        if i % 7 == 0:
            body["timeout"] = 0.05  # a deadline that passes mid-request
        jobs.append((body, mode))

    async def run() -> list[str]:
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient() as client:
            async def go(body, mode):
                async with sem:
                    return await one_stream(client, url, body, mode)
            return await asyncio.gather(*(go(b, m) for b, m in jobs))
    results = asyncio.run(run())
    assert results.count("disconnected") >= 30
    assert any(r.startswith("done-") for r in results)
    wait_until_idle(cluster)
    ok = complete(cluster, name_of(model_dir), [5, 6, 7])
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) > 0


def test_injected_transfer_failure(cluster, model_dir):
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    expected = LLM(model_dir).generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    expected_ids = expected[0].outputs[0].token_ids
    name = name_of(model_dir)
    for fallback in (True, False):
        cluster.deploy(settings(model_dir, fallback_to_local_prefill=fallback))
        serve.get_deployment_handle("PrefillServer", app_name="cluster").inject_transfer_failures.remote(1).result()
        resp = complete(cluster, name, prompt, logprobs=0, return_tokens_as_token_ids=True)
        if fallback:  # re-prefilled on the decode replica: same tokens
            assert resp.status_code == 200
            tokens = resp.json()["choices"][0]["logprobs"]["tokens"]
            assert [int(t.split(":")[1]) for t in tokens] == expected_ids
        else:
            assert resp.status_code == 500
            assert "injected transfer failure" in resp.json()["error"]["message"]
        failures = cluster.wait_for_metric("cluster:kv_transfer_failures_total", lambda v: sum(v) >= 1,
                                           role="prefill")
        assert sum(failures) >= 1
        assert complete(cluster, name, prompt).status_code == 200  # others go on
        wait_until_idle(cluster)


def test_bad_input_gets_openai_errors(cluster, model_dir):
    cluster.deploy(settings(model_dir))
    name = name_of(model_dir)
    url = f"{cluster.base_url}/v1/completions"
    cases = [
        ({"model": name, "prompt": [1] * 1100}, 400, "prompt"),
        ({"model": name, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": name, "prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"model": name, "prompt": "hi", "n": 0}, 400, "n"),
        ({"model": name, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ({"model": name, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"model": name, "prompt": [1, 2, 100000]}, 400, "prompt"),
    ]
    for body, status, param in cases:
        resp = httpx.post(url, json=body, timeout=30)
        assert resp.status_code == status, (body, resp.text)
        error = resp.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and param in (error["param"] or "") + error["message"]
    resp = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    resp = httpx.post(url, content=json.dumps({"model": name, "prompt": "x" * (5 << 20)}).encode(),
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 413
    chat = httpx.post(f"{cluster.base_url}/v1/chat/completions",
                      json={"model": name, "messages": "not a list"}, timeout=30)
    assert chat.status_code == 400
    assert complete(cluster, name, [5, 6, 7]).status_code == 200  # nothing crashed


def test_deadline_and_overload_statuses(cluster, model_dir):
    cluster.deploy(settings(model_dir, max_inflight_requests=2))
    name = name_of(model_dir)
    resp = complete(cluster, name, [5] * 50, max_tokens=500, timeout=0.01)
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "timeout_error"

    async def burst() -> list[int]:
        async with httpx.AsyncClient() as client:
            async def go():
                r = await client.post(f"{cluster.base_url}/v1/completions", timeout=60,
                                      json={"model": name, "prompt": [5] * 30, "max_tokens": 40, "ignore_eos": True})
                return r.status_code
            return await asyncio.gather(*(go() for _ in range(10)))
    statuses = asyncio.run(burst())
    assert 503 in statuses and 200 in statuses
    wait_until_idle(cluster)


def test_metrics_are_exposed_with_roles(cluster, model_dir):
    cluster.deploy(settings(model_dir))
    name = name_of(model_dir)
    for _ in range(3):
        assert complete(cluster, name, list(range(10, 60)), stream=False).status_code == 200
    time.sleep(1.0)  # let replicas report
    text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    for metric in ("cluster:time_to_first_token_seconds", "cluster:inter_token_latency_seconds",
                   "cluster:e2e_request_latency_seconds", "cluster:ttft_prefill_queue_seconds",
                   "cluster:ttft_prefill_compute_seconds", "cluster:ttft_kv_transfer_seconds",
                   "cluster:ttft_first_decode_seconds"):
        assert f"{metric}_count" in text, metric
    for metric in ("cluster:num_requests_running", "cluster:num_requests_waiting", "cluster:kv_cache_usage_perc",
                   "cluster:prefix_cache_hit_rate", "cluster:kv_transfer_bytes_total"):
        for role in ("prefill", "decode"):
            assert cluster.metric(metric, role=role), (metric, role)
    assert sum(cluster.metric("cluster:kv_transfer_bytes_total", role="prefill")) > 0
    assert cluster.metric("cluster:kv_transfer_seconds_count", role="prefill")
