"""Each routed Ray Serve call its own internal request id.

A handle call made while serving a request inherits that request's internal request id (Ray Serve
2.60: ``RequestMetadata.internal_request_id`` comes from the caller's request context). A
deployment with a custom ``RequestRouter`` indexes its pending requests by that id and skips a
second one with the same id, so of two concurrent calls made under one request the second is
never routed: an HTTP request with ``n=2`` (one decode call per sample) or a prompt list hung, and
its ingress failed its health check. The default router does not show it
(``tests/router/test_serve_routing.py`` reproduces both with plain Ray Serve).

Callers that may make several concurrent routed calls under one request (the ingress, one per
sample; a decode replica, one prefill per sample) call :func:`own_routing_id` first, in the
asyncio task that makes the call: the request context is a context variable, so the new id holds
for that task and the calls it makes, and nothing else."""
from __future__ import annotations

import dataclasses
import uuid


def own_routing_id() -> str:
    """Give the current task's Serve request context a fresh internal request id; returns it.
    Outside a Serve replica this sets up a context with just that id."""
    from ray.serve import context

    current = context._get_serve_request_context()
    fresh = str(uuid.uuid4())
    # Ray types the variable by its default (None); it holds _RequestContext values.
    context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=fresh))  # type: ignore[arg-type]
    return fresh
