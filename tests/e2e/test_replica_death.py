"""A decode replica killed under load (SIGKILL of its actor) through the real Ray app: requests
in flight on it end at once with a retryable 503 naming what failed (``replica_unavailable``,
``decode_replica_died``; it was a generic 500), any on the other replica complete, and new
requests are routed to the surviving replica."""
from __future__ import annotations

import asyncio
import time

import pytest

from tests.e2e.conftest import httpx
from tests.e2e.test_disaggregation import model_name
from tests.factories import mixed_prompts

pytestmark = pytest.mark.e2e


def _decode_actors() -> list[str]:
    import ray
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "DecodeServer" in a["name"]]


def _running_by_replica(cluster) -> dict[str, float]:
    """Decode replica id -> requests running there (its latest report)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    return {s.labels["replica"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "cluster:num_requests_running" and s.labels.get("role") == "decode"}


async def _complete(base_url: str, model: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(f"{base_url}/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def test_decode_replica_killed_under_load(cluster, model_dir):
    import ray
    cluster.deploy({"model": model_dir, "decode_replicas": 2, "kv_transfer": "ipc"})
    names = _decode_actors()
    assert len(names) == 2
    model = model_name(model_dir)
    prompts = mixed_prompts(300, (12,) * 10, seed=41)

    async def load_then_kill() -> list[httpx.Response]:
        tasks = [asyncio.ensure_future(_complete(cluster.base_url, model, p, 400)) for p in prompts]
        await asyncio.sleep(1.5)  # every request is decoding now
        busiest = max(_running_by_replica(cluster).items(), key=lambda kv: kv[1])[0]
        victim = next(n for n in names if n.endswith(busiest))
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        return await asyncio.wait_for(asyncio.gather(*tasks), 90)

    start = time.monotonic()
    answers = asyncio.run(load_then_kill())
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 503}, statuses
    died = [r.json()["error"] for r in answers if r.status_code == 503]
    assert died and all(e["type"] == "replica_unavailable" and e["code"] == "decode_replica_died" for e in died)
    assert "retry" in died[0]["message"]  # those on the other replica (if routed there) completed: 200
    assert time.monotonic() - start < 90
    async def new_requests() -> list[httpx.Response]:
        return await asyncio.wait_for(asyncio.gather(*(_complete(cluster.base_url, model, p, 8)
                                                       for p in prompts[:4])), 60)
    after = asyncio.run(new_requests())
    assert [r.status_code for r in after] == [200] * 4  # routed around the dead replica
    cluster.settings = None  # the next test redeploys
