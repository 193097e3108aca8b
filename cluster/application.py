"""The Serve application: ``serve run cluster.app [key=value ...]`` (``cluster.app`` is the builder
below, exported by the package) or a Serve config file (deploy/serve.yaml, ``import_path:
cluster.app`` with ``args``). Every setting of cluster/config.py is an argument; unknown or
invalid ones stop start-up with a message naming them."""
from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.common.errors import UnsupportedSettingError
from cluster.config import ClusterConfig, parse_cluster_args
from cluster.decode.server import DecodeServer
from cluster.models.registry import load_tokenizer
from cluster.prefill.server import PrefillServer
from cluster.prefill.worker import PrefillWorker
from cluster.router.ingress import Ingress
from cluster.router.planner import deployment_scaling
from cluster.router.routers import DecodeRouter, PrefillRouter
from cluster.router.state import ClusterState

logger = logging.getLogger(__name__)
ROUTING_STATS_PERIOD_S = 0.5


def resolve_num_gpus(config: ClusterConfig) -> float:
    if config.num_gpus is not None:
        return config.num_gpus
    device = config.model.device
    if device is not None and device.startswith("cpu"):
        return 0.0
    import torch
    return float(config.model.tensor_parallel_size) if torch.cuda.is_available() else 0.0


def build_app(args: dict[str, Any] | None = None) -> Any:
    config = parse_cluster_args(dict(args or {}))
    _apply_http_options(config)
    load_tokenizer(config.model.model)  # a missing model or tokenizer stops start-up here, by name
    gpus = resolve_num_gpus(config)
    if config.model.device and config.model.device.startswith("cuda") and gpus == 0:
        raise UnsupportedSettingError("device=cuda needs num_gpus > 0 per replica", param="num_gpus")
    cpus = 1.0 if gpus > 0 else 0.0
    actor = {"num_gpus": gpus, "num_cpus": cpus}
    state = ClusterState.bind()
    prefill = None
    local = config.transfer.backend == "local" and config.prefill_replicas > 0
    if config.prefill_replicas > 0 and not local:
        prefill = PrefillServer.options(
            **deployment_scaling(config, "prefill"), ray_actor_options=actor,
            request_router_config=RequestRouterConfig(
                request_router_class=PrefillRouter, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
        ).bind(config, state)
    decode = DecodeServer.options(
        **deployment_scaling(config, "decode"), ray_actor_options=actor,
        request_router_config=RequestRouterConfig(
            request_router_class=DecodeRouter, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
    ).bind(config, prefill, state, PrefillWorker if local else None)
    logger.info("pd-cluster: %d prefill + %d decode replicas of %s, kv_transfer=%s, %s GPU(s) each",
                config.prefill_replicas, config.decode_replicas, config.model.model, config.transfer.backend, gpus)
    return Ingress.bind(config, decode, state)


def _apply_http_options(config: ClusterConfig) -> None:
    """``serve run cluster.app host=... port=...``: start Serve's HTTP proxy there. Only from a
    driver (a Serve config file sets http_options itself, and builds the app inside the cluster)."""
    if (config.host, config.port) == ("127.0.0.1", 8000):
        return
    import ray
    if ray.is_initialized() and ray.get_runtime_context().worker.mode != ray.SCRIPT_MODE:
        return
    serve.start(http_options={"host": config.host, "port": config.port})


def run(args: dict[str, Any] | None = None, *, blocking: bool = False, name: str = "cluster") -> Any:
    """Start the application on the current Ray cluster (starting a local one if none)."""
    config = parse_cluster_args(dict(args or {}))
    serve.start(http_options={"host": config.host, "port": config.port})
    return serve.run(build_app(args), name=name, route_prefix="/", blocking=blocking)
