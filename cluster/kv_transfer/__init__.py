"""KV transfer between prefill and decode workers: one protocol (base.py), several backends
(local, ipc, nccl, nixl), chosen per deployment; ``make_backend`` builds one."""
from __future__ import annotations

from typing import Any

import torch

from cluster.common.errors import UnsupportedSettingError
from cluster.common.kv_spec import KVGroupSpec
from cluster.kv_transfer.base import BlockCopy, KVTransferBackend, TransferEndpoint

BACKENDS = ("auto", "local", "ipc", "nccl", "nixl")


def resolve_backend_name(name: str) -> str:
    """A valid backend name (``auto`` picks ipc or nixl per pair, see auto.py)."""
    if name not in BACKENDS:
        raise UnsupportedSettingError(f"kv_transfer={name!r} is not one of {list(BACKENDS)}",
                                      param="kv_transfer")
    return name


class KVStorage:
    """Allocates KV storage that a backend can move, then builds the backend over it."""

    def __init__(self, backend: str, engine_id: str, node_id: str = "", **options: Any) -> None:
        self.backend_name = resolve_backend_name(backend)
        self.engine_id = engine_id
        self.node_id = node_id
        self.options = options
        self._segments: list[Any] = []

    def allocate(self, specs: list[KVGroupSpec], num_blocks: list[int], device: torch.device,
                 dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        if self.backend_name in ("ipc", "auto"):
            from cluster.kv_transfer.ipc import IPCBackend, segment_prefix
            tensors, self._segments = IPCBackend.allocate_shared(specs, num_blocks, device, dtypes,
                                                                 prefix=segment_prefix(self.engine_id))
            return tensors
        return KVTransferBackend.allocate(specs, num_blocks, device, dtypes)

    def build(self, kv_caches: list[torch.Tensor], specs: list[KVGroupSpec]) -> KVTransferBackend:
        name = self.backend_name
        if name == "local":
            from cluster.kv_transfer.local import LocalBackend
            return LocalBackend(kv_caches, specs, self.engine_id, self.node_id)
        if name == "auto":
            from cluster.kv_transfer.auto import AutoBackend
            return AutoBackend(kv_caches, specs, self.engine_id, self.node_id, shm_segments=self._segments,
                               remote_peers=self.options.get("remote_peers"))
        if name == "ipc":
            from cluster.kv_transfer.ipc import IPCBackend
            return IPCBackend(kv_caches, specs, self.engine_id, self.node_id, shm_segments=self._segments)
        if name == "nccl":
            from cluster.kv_transfer.nccl import NCCLBackend
            return NCCLBackend(kv_caches, specs, self.engine_id, self.node_id, **self.options)
        from cluster.kv_transfer.nixl import NIXLBackend
        return NIXLBackend(kv_caches, specs, self.engine_id, self.node_id)


__all__ = ["BACKENDS", "BlockCopy", "KVStorage", "KVTransferBackend", "TransferEndpoint", "resolve_backend_name"]
