"""``local``: sender and receiver in one process (colocated tests); a plain indexed copy."""
from __future__ import annotations

import threading
import weakref
from typing import Any

from cluster.common.errors import KVTransferError
from cluster.kv_transfer.base import BlockCopy, KVTransferBackend, TransferEndpoint, index_tensor

_REGISTRY: weakref.WeakValueDictionary[str, LocalBackend] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


class LocalBackend(KVTransferBackend):
    name = "local"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        with _LOCK:
            _REGISTRY[self.engine_id] = self

    def _endpoint_info(self) -> dict[str, Any]:
        return {}

    def _send(self, dest: TransferEndpoint, request_key: str, copies: list[BlockCopy], last: bool) -> int:
        with _LOCK:
            peer = _REGISTRY.get(dest.engine_id)
        if peer is None or peer.generation != dest.generation:
            raise KVTransferError(f"no local receiver {dest.engine_id} of generation {dest.generation}")
        for c in copies:
            src, dst = self.kv_caches[c.group], peer.kv_caches[c.group]
            dst.index_copy_(0, index_tensor(c.dst, dst.device), src.index_select(0, index_tensor(c.src, src.device)))
        return self.block_bytes(copies)

    def close(self) -> None:
        with _LOCK:
            if _REGISTRY.get(self.engine_id) is self:
                del _REGISTRY[self.engine_id]
