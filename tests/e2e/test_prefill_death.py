"""The prefill replica killed (SIGKILL of its actor) while the decode replica's KV is fully, then
half, reserved for the prompts it is computing, through the real Ray app: every request falls back
to a prefill on the decode replica, which waits for blocks (the reservations come back after
their grace period) instead of dropping requests, and all 16 streams answer, equal to offline
greedy decoding. Before, with the KV full, all 16 streams stayed open without a byte until the
clients gave up; and a request that came just after the kill got a 503 (no block to reserve)
instead of waiting its turn."""
from __future__ import annotations

import asyncio
import math
import time

import pytest

from cluster import LLM, SamplingParams
from tests.e2e.conftest import httpx
from tests.e2e.test_disaggregation import model_name
from tests.factories import mixed_prompts

pytestmark = pytest.mark.e2e
PROMPTS = mixed_prompts(300, (900,) * 16, seed=51)
BLOCK = 16
MAX_TOKENS = 6


def _prefill_actors() -> list[str]:
    import ray
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "PrefillServer" in a["name"]]


async def _stream(base_url: str, model: str, prompt: list[int]) -> tuple[int, list[int], str | None]:
    """(status, token ids, finish reason) of a streamed greedy completion, read to [DONE]."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    ids: list[int] = []
    finish = None
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return resp.status_code, [], (await resp.aread()).decode()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                import json
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    if choice.get("logprobs"):
                        ids += [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
                    finish = choice.get("finish_reason") or finish
    return 200, ids, finish


@pytest.fixture(scope="module")
def expected(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in LLM(model_dir, block_size=BLOCK).generate(PROMPTS, params)]


@pytest.mark.parametrize("fill", ["full", "half"])
def test_prefill_replica_killed_with_decode_kv_reserved(cluster, model_dir, expected, fill):
    import ray
    per_prompt = math.ceil((len(PROMPTS[0]) + MAX_TOKENS) / BLOCK)
    blocks = len(PROMPTS) * per_prompt * (1 if fill == "full" else 2) + 1  # + the null block
    # Small prefill chunks: the prompts are still being computed when the replica dies.
    cluster.deploy({"model": model_dir, "kv_transfer": "ipc", "block_size": BLOCK, "num_kv_blocks": blocks,
                    "max_num_batched_tokens": 64, "remote_kv_grace_s": 1.0})
    model = model_name(model_dir)
    failures_before = cluster.metric_by_replica("cluster:remote_prefill_failures_total", role="decode")

    assert asyncio.run(_stream(cluster.base_url, model, PROMPTS[0][:20]))[0] == 200  # every path warm

    def prefilling() -> bool:
        return sum(cluster.metric("cluster:num_requests_running", role="prefill")) > 0

    def failed() -> bool:
        return cluster.increase("cluster:remote_prefill_failures_total", failures_before, role="decode") > 0

    async def load_then_kill():
        tasks = [asyncio.ensure_future(_stream(cluster.base_url, model, p)) for p in PROMPTS]
        deadline = time.monotonic() + 10
        while not await asyncio.to_thread(prefilling) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        names = _prefill_actors()  # now: a redeploy's replaced replicas may have lingered before
        assert names
        for name in names:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        # One more once decode knows: with the KV full (reservations held for their grace, the
        # fallbacks queued) it waits its turn for blocks instead of a 503.
        deadline = time.monotonic() + 10
        while not await asyncio.to_thread(failed) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        tasks.append(asyncio.ensure_future(_stream(cluster.base_url, model, PROMPTS[0])))
        return await asyncio.wait_for(asyncio.gather(*tasks), 90)

    start = time.monotonic()
    answers = asyncio.run(load_then_kill())
    assert [status for status, _, _ in answers] == [200] * 17, answers
    assert all(finish == "length" for _, _, finish in answers)
    assert [ids for _, ids, _ in answers] == expected + expected[:1]
    assert time.monotonic() - start < 90
    failures = cluster.wait_for_increase("cluster:remote_prefill_failures_total", failures_before, 0, role="decode")
    assert failures > 0, "no prefill was in flight when the replica died"
    usage = cluster.wait_for_metric("cluster:kv_cache_usage_perc", lambda v: v and max(v) == 0.0, role="decode")
    assert usage and max(usage) == 0.0  # the reservations and the fallbacks' blocks all came back
    cluster.settings = None  # the prefill replica was replaced: the next test redeploys
