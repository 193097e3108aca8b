"""Concurrent handle calls made under one Ray Serve request, to a deployment with a custom request
router: with the inherited internal request id the second call is never routed (Ray Serve 2.60;
the default router routes both), with ``own_routing_id`` in each calling task every call is.
This is the pattern of an HTTP request with ``n > 1`` or a prompt list (one decode call per
sample) and of a decode replica's prefill calls."""
from __future__ import annotations

import asyncio

import pytest
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cluster.common.serve_routing import own_routing_id

pytestmark = pytest.mark.e2e


class AnyReplica(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        return [candidate_replicas]


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Child:
    async def __call__(self, i: int) -> int:
        await asyncio.sleep(0.05)
        return i


CustomChild = Child.options(name="CustomChild", request_router_config=RequestRouterConfig(request_router_class=AnyReplica))


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Parent:
    def __init__(self, child, own_ids: bool) -> None:
        self.child, self.own_ids = child, own_ids

    async def __call__(self, n: int) -> list[int] | str:
        async def one(i: int) -> int:
            if self.own_ids:
                own_routing_id()
            return await self.child.remote(i)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 8.0)
        except TimeoutError:
            return "hung"


@pytest.fixture(scope="module")
def serve_instance():
    """A local Ray with Serve, or the one the end-to-end tests already started (left running)."""
    import ray
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        serve.start()
    yield
    for name in APPS:
        serve.delete(name)
    if started:
        serve.shutdown()
        ray.shutdown()


APPS = ("routing-default", "routing-inherited", "routing-own")


def test_each_concurrent_call_under_one_request_is_routed(serve_instance):
    default = serve.run(Parent.bind(Child.bind(), False), name=APPS[0], route_prefix=None)
    assert default.remote(3).result(timeout_s=30) == [0, 1, 2]
    inherited = serve.run(Parent.bind(CustomChild.bind(), False), name=APPS[1], route_prefix=None)
    assert inherited.remote(3).result(timeout_s=30) == "hung"  # what n=2 requests did before
    own = serve.run(Parent.bind(CustomChild.bind(), True), name=APPS[2], route_prefix=None)
    assert own.remote(3).result(timeout_s=30) == [0, 1, 2]
