"""The KV transfer protocol, shared by every backend.

A decode worker (receiver) describes its KV memory once in a TransferEndpoint: backend, engine
id, a generation that changes whenever the worker restarts, its node, the layout of each KV group
(blocks, bytes per block, dtype) and backend details (shared-memory names, CUDA IPC handles, a
TCP store address, NIXL agent metadata). A prefill worker (sender) connects to an endpoint once
per (engine id, generation) and then, per request, writes lists of (source block -> destination
block) per group, marking the request's last write. A cached connection whose generation is
stale is dropped and renegotiated, never used.

Senders block until the bytes are in the receiver's memory (or raise KVTransferError); a
receiver's ``wait_received`` returns once a request's last write has landed. ``send`` may be
called from several threads at once for different receivers (the prefill worker runs a sender
thread per decode worker); writes to one receiver come from one thread, in order."""
from __future__ import annotations

import abc
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from cluster.common.errors import KVTransferError
from cluster.common.kv_spec import KVGroupSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupLayout:
    name: str
    num_blocks: int
    #: Bytes of one block across all the group's layers (a row of the storage tensor).
    block_bytes: int
    dtype: str
    #: Storage shape without the block dimension: (num_layers, *block_shape).
    row_shape: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[GroupLayout, ...]
    device: str

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor], specs: list[KVGroupSpec]) -> KVLayout:
        groups = tuple(
            GroupLayout(spec.name, t.shape[0], t[0].numel() * t.element_size(),
                        str(t.dtype).removeprefix("torch."), tuple(t.shape[1:]))
            for spec, t in zip(specs, kv_caches))
        return cls(groups, kv_caches[0].device.type)

    def check_compatible(self, other: KVLayout) -> None:
        mine = [(g.name, g.block_bytes, g.dtype, g.row_shape) for g in self.groups]
        theirs = [(g.name, g.block_bytes, g.dtype, g.row_shape) for g in other.groups]
        if mine != theirs:
            raise KVTransferError(f"KV layouts differ: sender {mine} vs receiver {theirs}")


@dataclass(frozen=True)
class TransferEndpoint:
    backend: str
    engine_id: str
    generation: str
    node_id: str
    layout: KVLayout
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class BlockCopy:
    """Copy sender blocks ``src[i]`` into receiver blocks ``dst[i]`` of KV group ``group``."""

    group: int
    src: list[int]
    dst: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.src)


@dataclass
class TransferStats:
    bytes_total: int = 0
    seconds_total: float = 0.0
    count: int = 0
    failures_total: int = 0


class KVTransferBackend(abc.ABC):
    """One worker's side of KV transfer; every worker can both send and receive."""

    name: ClassVar[str]

    def __init__(self, kv_caches: list[torch.Tensor], specs: list[KVGroupSpec], engine_id: str,
                 node_id: str = "") -> None:
        self.kv_caches = kv_caches
        self.specs = specs
        self.engine_id = engine_id
        self.node_id = node_id
        self.generation = uuid.uuid4().hex
        self.layout = KVLayout.of(kv_caches, specs)
        self.stats = TransferStats()
        self._stats_lock = threading.Lock()
        #: Test hook: fail this many upcoming sends.
        self.inject_failures = 0

    @staticmethod
    def allocate(specs: list[KVGroupSpec], num_blocks: list[int], device: torch.device,
                 dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        """KV storage tensors ``[num_blocks, num_layers, *block_shape]`` this backend can move."""
        return [torch.zeros((n, spec.num_layers, *spec.block_shape), dtype=dt, device=device)
                for spec, n, dt in zip(specs, num_blocks, dtypes)]

    # --- receiver ------------------------------------------------------------------------------

    def endpoint(self) -> TransferEndpoint:
        return TransferEndpoint(self.name, self.engine_id, self.generation, self.node_id, self.layout,
                                self._endpoint_info())

    @abc.abstractmethod
    def _endpoint_info(self) -> dict[str, Any]: ...

    def wait_received(self, request_key: str, timeout_s: float, sender_node: str | None = None) -> None:
        """Block until the request's last write has landed (synchronous backends: at once).
        ``sender_node``: where the sender runs (backends that pick a path per pair use it)."""

    def forget(self, request_key: str) -> None:
        """Drop receive-side state of a request that will not complete."""

    # --- sender ---------------------------------------------------------------------------------

    def send(self, dest: TransferEndpoint, request_key: str, copies: list[BlockCopy], last: bool) -> int:
        """Write blocks into ``dest``; returns the bytes moved. Raises KVTransferError."""
        if dest.backend != self.name:
            raise KVTransferError(f"endpoint speaks {dest.backend!r}, this worker {self.name!r}")
        self.layout.check_compatible(dest.layout)
        copies = [c for c in copies if c.num_blocks]
        start = time.perf_counter()
        try:
            with self._stats_lock:
                inject, self.inject_failures = self.inject_failures > 0, max(0, self.inject_failures - 1)
            if inject:
                raise KVTransferError("injected transfer failure")
            moved = self._send(dest, request_key, copies, last)
        except KVTransferError:
            self._count_failure()
            self._drop_peer(dest)
            raise
        except Exception as exc:  # noqa: BLE001 - any backend failure is a transfer failure
            self._count_failure()
            self._drop_peer(dest)
            raise KVTransferError(f"{self.name} transfer to {dest.engine_id} failed: {exc}") from exc
        with self._stats_lock:
            self.stats.bytes_total += moved
            self.stats.seconds_total += time.perf_counter() - start
            self.stats.count += 1
        return moved

    def _count_failure(self) -> None:
        with self._stats_lock:
            self.stats.failures_total += 1

    @abc.abstractmethod
    def _send(self, dest: TransferEndpoint, request_key: str, copies: list[BlockCopy], last: bool) -> int: ...

    def _drop_peer(self, dest: TransferEndpoint) -> None:
        """Forget the connection to ``dest`` (it is renegotiated on the next send)."""

    def close(self) -> None:
        """Release memory registrations, connections and shared segments."""

    def block_bytes(self, copies: list[BlockCopy]) -> int:
        return sum(c.num_blocks * self.layout.groups[c.group].block_bytes for c in copies)


class PeerCache:
    """Connections by receiver engine id, replaced when the receiver's generation changes."""

    def __init__(self) -> None:
        self._peers: dict[str, tuple[str, Any]] = {}

    def get(self, dest: TransferEndpoint, connect: Any) -> Any:
        cached = self._peers.get(dest.engine_id)
        if cached is not None and cached[0] == dest.generation:
            return cached[1]
        if cached is not None:
            logger.info("receiver %s restarted (generation changed): renegotiating", dest.engine_id)
        peer = connect(dest)
        self._peers[dest.engine_id] = (dest.generation, peer)
        return peer

    def drop(self, engine_id: str) -> Any:
        cached = self._peers.pop(engine_id, None)
        return None if cached is None else cached[1]

    def values(self) -> list[Any]:
        return [peer for _, peer in self._peers.values()]


def index_tensor(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=device)


def rows(storage: torch.Tensor) -> torch.Tensor:
    """A storage tensor as ``[num_blocks, block_bytes]`` uint8 (a view: writes go through)."""
    return storage.view(storage.shape[0], -1).view(torch.uint8)
