"""Settings: key=value parsing into typed configs, environment fallbacks, and clear refusals of
unknown or invalid settings."""
from __future__ import annotations

import pytest

from cluster.common.errors import UnsupportedSettingError
from cluster.config import FLAT_FIELDS, parse_cluster_args


def test_defaults():
    cfg = parse_cluster_args({}, use_env=False)
    assert cfg.model.model == "smollm2" and cfg.prefill_replicas == 1 and cfg.decode_replicas == 1
    assert cfg.transfer.backend == "auto" and cfg.port == 8000


def test_strings_are_coerced_to_field_types():
    cfg = parse_cluster_args({"model": "/m", "prefill_replicas": "2", "kv_transfer": "nccl",
                              "enable_prefix_caching": "false", "gpu_memory_utilization": "0.5",
                              "max_model_len": "none", "block_size": 32}, use_env=False)
    assert cfg.model.model == "/m" and cfg.prefill_replicas == 2 and cfg.transfer.backend == "nccl"
    assert cfg.cache.enable_prefix_caching is False and cfg.cache.gpu_memory_utilization == 0.5
    assert cfg.model.max_model_len is None and cfg.cache.block_size == 32


def test_every_setting_is_reachable():
    assert {"model", "dtype", "block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
            "kv_transfer", "kv_transfer_timeout_s", "local_prefill_threshold", "prefill_replicas",
            "decode_replicas", "attention_backend", "moe_backend", "draft_moe_backend",
            "load_format"} <= set(FLAT_FIELDS)
    assert parse_cluster_args({"load_format": "dummy"}, use_env=False).model.load_format == "dummy"


def test_environment_fills_missing_settings(monkeypatch):
    monkeypatch.setenv("CLUSTER_DECODE_REPLICAS", "3")
    assert parse_cluster_args({}).decode_replicas == 3
    assert parse_cluster_args({"decode_replicas": 1}).decode_replicas == 1


@pytest.mark.parametrize("args, name", [
    ({"modle": "x"}, "modle"),
    ({"prefill_replicas": "two"}, "prefill_replicas"),
    ({"kv_transfer": "carrier-pigeon"}, "kv_transfer"),
    ({"block_size": 0}, "block_size"),
    ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching"),
    ({"dtype": "float64"}, "dtype"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"load_format": "random"}, "load_format"),
])
def test_invalid_settings_are_refused_by_name(args, name):
    with pytest.raises(UnsupportedSettingError, match=name):
        parse_cluster_args(args, use_env=False)
