"""The ingress's conditional disaggregation (``cluster.router.ingress.prefill_locally``): which
prompts the decode replica prefills itself, from the config and the ingress's cluster view. No
Ray: the rule is a function of the config and the replicas' reports, and ``_route`` is called on
a stand-in holding the config and the view."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.common.errors import UnsupportedSettingError
from cluster.common.messages import GenerateRequest, ReplicaStats
from cluster.common.sampling_params import SamplingParams
from cluster.config import parse_cluster_args
from cluster.router.ingress import Ingress, prefill_locally


def _config(**kw):
    return parse_cluster_args({"prefill_replicas": 2, **kw}, use_env=False)


def _stats(role: str, waiting: int, i: int = 0) -> ReplicaStats:
    return ReplicaStats(role=role, replica_id=f"{role}-{i}", num_requests_waiting=waiting)


def test_saturated_prefill_pool_prefills_on_decode():
    cfg = _config(local_prefill_queue_threshold=4)
    full = [_stats("prefill", 4, 0), _stats("prefill", 9, 1), _stats("decode", 0)]
    assert prefill_locally(1000, cfg, full)
    # one prefill replica with room left: the pool is not saturated
    assert not prefill_locally(1000, cfg, [_stats("prefill", 3, 0), _stats("prefill", 9, 1)])
    # decode replicas' queues do not count
    assert not prefill_locally(1000, cfg, [_stats("prefill", 0), _stats("decode", 50)])
    # no prefill report in the view: no evidence of saturation
    assert not prefill_locally(1000, cfg, [_stats("decode", 50)])
    assert not prefill_locally(1000, cfg, [])


def test_existing_rules_and_disabling():
    assert prefill_locally(5, _config(local_prefill_threshold=10), [])  # short prompt
    assert not prefill_locally(10, _config(local_prefill_threshold=10), [])
    assert prefill_locally(1000, parse_cluster_args({"prefill_replicas": 0}, use_env=False), [])
    off = _config(local_prefill_queue_threshold=0)
    assert not prefill_locally(1000, off, [_stats("prefill", 10_000)])


def test_setting_default_and_validation():
    assert _config().transfer.local_prefill_queue_threshold == 16
    assert _config(local_prefill_queue_threshold="3").transfer.local_prefill_queue_threshold == 3
    with pytest.raises(UnsupportedSettingError):
        _config(local_prefill_queue_threshold=-1)


def test_route_reads_the_cluster_view():
    route = Ingress.func_or_class._route  # the method alone: an Ingress needs Serve to be built
    ingress = SimpleNamespace(config=_config(local_prefill_queue_threshold=2),
                              _snapshot=[_stats("prefill", 1, 0), _stats("prefill", 5, 1)])
    req = GenerateRequest("r1", list(range(100)), SamplingParams())
    route(ingress, req)
    assert req.local_prefill is False and req.block_hashes
    ingress._snapshot = [_stats("prefill", 2, 0), _stats("prefill", 5, 1)]
    req = GenerateRequest("r2", list(range(100)), SamplingParams())
    route(ingress, req)
    assert req.local_prefill is True
