"""``nixl``: NIXL agents over UCX (NVLink/CUDA IPC, RDMA, TCP or shared memory, as UCX finds).

Each worker registers its KV storage with its agent once. The endpoint carries the agent's
metadata and each group's base address, so a sender adds the receiver as a remote agent (once
per generation) and WRITEs block rows straight into the receiver's memory; the request's last
write carries a notification naming the request, which the receiver waits for. A stale remote
agent (receiver restarted) is removed and re-added from the new metadata."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from cluster.common.errors import KVTransferError
from cluster.common.kv_spec import KVGroupSpec
from cluster.kv_transfer.base import BlockCopy, KVTransferBackend, PeerCache, TransferEndpoint

logger = logging.getLogger(__name__)


def _import_nixl() -> tuple[Any, Any]:
    """NIXL's agent classes from the meta package or either CUDA build (the CUDA-12 build also
    serves CPU-only machines)."""
    import importlib
    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = importlib.import_module(module)
        except ImportError:
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise KVTransferError("kv_transfer=nixl needs NIXL: pip install nixl (or nixl-cu12)")


class NIXLBackend(KVTransferBackend):
    name = "nixl"

    def __init__(self, kv_caches: list[torch.Tensor], specs: list[KVGroupSpec], engine_id: str,
                 node_id: str = "", timeout_s: float = 60.0) -> None:
        super().__init__(kv_caches, specs, engine_id, node_id)
        nixl_agent, nixl_agent_config = _import_nixl()
        self.timeout_s = timeout_s
        self.agent_name = f"{engine_id}-{self.generation[:8]}"
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(backends=["UCX"]))
        self._registrations = [self.agent.register_memory(t) for t in kv_caches]
        self.mem_type = "VRAM" if kv_caches[0].is_cuda else "DRAM"
        self.device_id = (kv_caches[0].device.index or 0) if kv_caches[0].is_cuda else 0
        self._peers = PeerCache()
        self._notified: set[str] = set()
        self._lock = threading.Lock()
        self._agent_lock = threading.RLock()

    def _endpoint_info(self) -> dict[str, Any]:
        return {
            "agent_metadata": self.agent.get_agent_metadata(),
            "agent_name": self.agent_name,
            "base": [t.data_ptr() for t in self.kv_caches],
            "mem": self.mem_type,
            "device_id": self.device_id,
        }

    # --- receiver ---------------------------------------------------------------------------------

    def wait_received(self, request_key: str, timeout_s: float, sender_node: str | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                for messages in self.agent.get_new_notifs().values():
                    self._notified.update(m.decode() for m in messages)
                if request_key in self._notified:
                    self._notified.discard(request_key)
                    return
            if time.monotonic() > deadline:
                raise KVTransferError(f"KV for request {request_key} did not arrive within {timeout_s:.1f}s")
            time.sleep(0.0005)

    def forget(self, request_key: str) -> None:
        with self._lock:
            self._notified.discard(request_key)

    # --- sender ------------------------------------------------------------------------------------

    def _connect(self, dest: TransferEndpoint) -> str:
        name = self.agent.add_remote_agent(dest.info["agent_metadata"])
        return name.decode() if isinstance(name, bytes) else str(name)

    def _send(self, dest: TransferEndpoint, request_key: str, copies: list[BlockCopy], last: bool) -> int:
        # Agent calls are serialised (sending threads, one per receiver, share the agent); the
        # wait for a transfer to finish polls between calls, so the others' go on meanwhile.
        with self._agent_lock:
            remote = self._peers.get(dest, self._connect)
        src, dst = [], []
        for c in copies:
            row = self.layout.groups[c.group].block_bytes
            base, remote_base = self.kv_caches[c.group].data_ptr(), dest.info["base"][c.group]
            src += [(base + b * row, row, self.device_id) for b in c.src]
            dst += [(remote_base + b * row, row, dest.info["device_id"]) for b in c.dst]
        if not src and not last:
            return 0
        if not src:  # nothing left to move, but the receiver still needs the notification
            with self._agent_lock:
                self.agent.send_notif(remote, request_key.encode())
            return 0
        notif = request_key.encode() if last else b""
        with self._agent_lock:
            src_descs = self.agent.get_xfer_descs(src, self.mem_type)
            dst_descs = self.agent.get_xfer_descs(dst, dest.info["mem"])
            handle = self.agent.initialize_xfer("WRITE", src_descs, dst_descs, remote, notif)
        try:
            with self._agent_lock:
                started = self.agent.transfer(handle)
            if started == "ERR":
                raise KVTransferError("NIXL transfer failed to start")
            deadline = time.monotonic() + self.timeout_s
            while True:
                with self._agent_lock:
                    state = self.agent.check_xfer_state(handle)
                if state == "DONE":
                    break
                if state == "ERR":
                    raise KVTransferError("NIXL transfer failed")
                if time.monotonic() > deadline:
                    raise KVTransferError(f"NIXL transfer did not finish within {self.timeout_s:.1f}s")
        finally:
            with self._agent_lock:
                self.agent.release_xfer_handle(handle)
        return self.block_bytes(copies)

    def _drop_peer(self, dest: TransferEndpoint) -> None:
        with self._agent_lock:
            name = self._peers.drop(dest.engine_id)
        if name is not None:
            try:
                with self._agent_lock:
                    self.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def close(self) -> None:
        for registration in self._registrations:
            try:
                self.agent.deregister_memory(registration)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self._registrations = []
