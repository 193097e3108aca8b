"""``auto``: the transport is chosen per prefill/decode pair: ``ipc`` (CUDA IPC or shared memory,
one copy at memory speed) when the receiver is on this node, ``nixl`` otherwise. The sender picks
by comparing the receiver's node with its own, and the receiver learns the sender's node from
the prefill result, so it knows whether to wait for NIXL's notification.

NIXL is started only when a peer on another node can exist: a NIXL agent's UCX progress threads
poll the CPU while it lives (about 1.5 of 2 cores on an idle single-node service), so a sender
creates its agent at its first cross-node send, and a receiver when ``remote_peers()`` says the
cluster has another node (its endpoint then carries the agent's description as well as ipc's)."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import torch

from cluster.common.errors import KVTransferError
from cluster.common.kv_spec import KVGroupSpec
from cluster.kv_transfer.base import BlockCopy, KVTransferBackend, TransferEndpoint
from cluster.kv_transfer.ipc import IPCBackend

logger = logging.getLogger(__name__)


class AutoBackend(KVTransferBackend):
    name = "auto"

    def __init__(self, kv_caches: list[torch.Tensor], specs: list[KVGroupSpec], engine_id: str,
                 node_id: str = "", shm_segments: list[shared_memory.SharedMemory] | None = None,
                 remote_peers: Callable[[], bool] | None = None) -> None:
        super().__init__(kv_caches, specs, engine_id, node_id)
        self.ipc = IPCBackend(kv_caches, specs, engine_id, node_id, shm_segments=shm_segments)
        self.nixl: KVTransferBackend | None = None
        self._nixl_error: str | None = None
        self._remote_peers = remote_peers or (lambda: False)
        self._lock = threading.Lock()

    def _start_nixl(self) -> KVTransferBackend | None:
        """The NIXL backend, created on first need (None, logged once, where NIXL cannot start)."""
        with self._lock:
            if self.nixl is None and self._nixl_error is None:
                try:
                    from cluster.kv_transfer.nixl import NIXLBackend
                    self.nixl = NIXLBackend(self.kv_caches, self.specs, self.engine_id, self.node_id)
                    logger.info("NIXL agent started for %s (a peer on another node)", self.engine_id)
                except (KVTransferError, RuntimeError, OSError) as exc:  # ipc still serves this node
                    self._nixl_error = str(exc)
                    logger.warning("NIXL unavailable (%s): KV moves only between workers on one node", exc)
            return self.nixl

    def _endpoint_info(self) -> dict[str, Any]:
        nixl = self.nixl if self.nixl is not None or not self._remote_peers() else self._start_nixl()
        return {"ipc": self.ipc.endpoint(), "nixl": None if nixl is None else nixl.endpoint()}

    def _path(self, node: str | None) -> tuple[str, KVTransferBackend | None]:
        if not node or not self.node_id or node == self.node_id:
            return "ipc", self.ipc
        return "nixl", self.nixl

    def _send(self, dest: TransferEndpoint, request_key: str, copies: list[BlockCopy], last: bool) -> int:
        path, backend = self._path(dest.node_id)
        if path == "nixl" and backend is None:
            backend = self._start_nixl()
        inner = dest.info.get(path)
        if backend is None or inner is None:
            raise KVTransferError(f"receiver {dest.engine_id} is on another node and NIXL is not available "
                                  "on both sides (pip install nixl)")
        return backend._send(inner, request_key, copies, last)

    def wait_received(self, request_key: str, timeout_s: float, sender_node: str | None = None) -> None:
        _, backend = self._path(sender_node)
        if backend is None:
            raise KVTransferError("a remote sender wrote KV but NIXL is not available here")
        backend.wait_received(request_key, timeout_s)

    def forget(self, request_key: str) -> None:
        if self.nixl is not None:
            self.nixl.forget(request_key)

    def _drop_peer(self, dest: TransferEndpoint) -> None:
        path, backend = self._path(dest.node_id)
        inner = dest.info.get(path)
        if backend is not None and inner is not None:
            backend._drop_peer(inner)

    def close(self) -> None:
        if self.nixl is not None:
            self.nixl.close()
        self.ipc.close()
