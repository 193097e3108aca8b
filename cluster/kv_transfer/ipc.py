"""``ipc``: sender and receiver on one host. Between GPU processes the receiver exports its KV
storage once through CUDA IPC handles (torch's ``reduce_tensor``) and the sender maps it and copies
blocks on its own stream; between CPU processes the receiver's KV storage lives in POSIX shared
memory segments that the sender maps by name. Either way a send is a direct device-to-device (or
memory-to-memory) indexed copy, complete when ``send`` returns. Each sending thread copies on a
stream of its own, after the stream that computed the KV."""
from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import socket
import threading
from multiprocessing import shared_memory
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from cluster.common.errors import KVTransferError
from cluster.common.kv_spec import KVGroupSpec
from cluster.kv_transfer.base import BlockCopy, KVTransferBackend, PeerCache, TransferEndpoint, index_tensor
from kernels.block_copy import copy_blocks_ref

logger = logging.getLogger(__name__)


def _open_shm(name: str) -> shared_memory.SharedMemory:
    # Attaching must not register the segment with this process's resource tracker, or the
    # tracker would unlink the receiver's memory when the sender exits.
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    except TypeError:  # Python < 3.13
        from multiprocessing import resource_tracker
        shm = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return shm


#: Where POSIX shared memory segments appear as files (Linux).
SHM_DIR = "/dev/shm"


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def segment_prefix(engine_id: str) -> str:
    """Names of an engine's KV segments: ``pdc-<host>-<pid>-<engine id>``, so that segments of a
    process that died before unlinking them can be found and removed (see
    :func:`remove_orphaned_segments`)."""
    return f"pdc-{_host_tag()}-{os.getpid()}-{engine_id}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def remove_orphaned_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink KV segments made on this host by processes that no longer exist: a replica killed
    (out of memory, SIGKILL) never unlinks its segments, which would otherwise hold their memory
    until the machine restarts. Segments of live processes and of other hosts sharing the
    directory are left alone. Returns the names removed."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    pattern = re.compile(rf"pdc-{_host_tag()}-(\d+)-.+")
    removed = []
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            continue
        removed.append(name)
    if removed:
        logger.info("removed %d KV shared-memory segments of processes that are gone", len(removed))
    return removed


class IPCBackend(KVTransferBackend):
    name = "ipc"

    def __init__(self, kv_caches: list[torch.Tensor], specs: list[KVGroupSpec], engine_id: str,
                 node_id: str = "", shm_segments: list[shared_memory.SharedMemory] | None = None) -> None:
        super().__init__(kv_caches, specs, engine_id, node_id)
        self._segments = shm_segments or []
        self._peers = PeerCache()
        self._streams = threading.local()  # one copy stream per sending thread

    @classmethod
    def allocate_shared(cls, specs: list[KVGroupSpec], num_blocks: list[int], device: torch.device,
                        dtypes: list[torch.dtype], prefix: str
                        ) -> tuple[list[torch.Tensor], list[shared_memory.SharedMemory]]:
        """CPU KV storage in named shared-memory segments (zeroed); CUDA storage as usual."""
        if device.type == "cuda":
            return cls.allocate(specs, num_blocks, device, dtypes), []
        remove_orphaned_segments()
        tensors, segments = [], []
        for g, (spec, n, dt) in enumerate(zip(specs, num_blocks, dtypes)):
            shape = (n, spec.num_layers, *spec.block_shape)
            size = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            shm = shared_memory.SharedMemory(name=f"{prefix}-g{g}", create=True, size=max(1, size))
            segments.append(shm)
            tensor = torch.frombuffer(shm.buf, dtype=dt, count=math.prod(shape)).view(shape)
            tensor.zero_()
            tensors.append(tensor)
        return tensors, segments

    def _endpoint_info(self) -> dict[str, Any]:
        if self.kv_caches[0].is_cuda:
            return {"cuda": [reduce_tensor(t)[1] for t in self.kv_caches]}
        if not self._segments:
            raise KVTransferError("ipc on CPU needs KV storage in shared memory (allocate_shared)")
        return {"shm": [s.name for s in self._segments]}

    def _connect(self, dest: TransferEndpoint) -> list[Any]:
        if "cuda" in dest.info:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor
            return [rebuild_cuda_tensor(*args) for args in dest.info["cuda"]]
        segments = [_open_shm(name) for name in dest.info["shm"]]
        tensors = []
        for g, shm in zip(dest.layout.groups, segments):
            dtype = getattr(torch, g.dtype)
            count = g.num_blocks * math.prod(g.row_shape)
            tensors.append(torch.frombuffer(shm.buf, dtype=dtype, count=count).view(g.num_blocks, *g.row_shape))
        return [tensors, segments]

    def _send(self, dest: TransferEndpoint, request_key: str, copies: list[BlockCopy], last: bool) -> int:
        if dest.node_id and self.node_id and dest.node_id != self.node_id:
            raise KVTransferError(f"ipc needs one host: receiver on {dest.node_id}, sender on {self.node_id}")
        peer = self._peers.get(dest, self._connect)
        remote = peer if "cuda" in dest.info else peer[0]
        device = self.kv_caches[0].device
        if device.type == "cuda":
            stream = getattr(self._streams, "stream", None)
            if stream is None:
                stream = self._streams.stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.default_stream(device))
            with torch.cuda.stream(stream):
                self._copy(remote, copies)
            stream.synchronize()
        else:
            self._copy(remote, copies)
        return self.block_bytes(copies)

    def _copy(self, remote: list[torch.Tensor], copies: list[BlockCopy]) -> None:
        for c in copies:
            src, dst = self.kv_caches[c.group], remote[c.group]
            if src.is_cuda:  # one pass over the bytes, straight into the peer's mapped memory
                from kernels.triton_block_copy import copy_blocks_triton
                copy_blocks_triton(src, dst, index_tensor(c.src, src.device), index_tensor(c.dst, src.device))
            else:
                copy_blocks_ref(src, dst, index_tensor(c.src, src.device), index_tensor(c.dst, dst.device))

    def _drop_peer(self, dest: TransferEndpoint) -> None:
        self._close_peer(self._peers.drop(dest.engine_id))

    @staticmethod
    def _close_peer(peer: Any) -> None:
        if isinstance(peer, list) and len(peer) == 2 and isinstance(peer[1], list):
            peer[0].clear()
            for shm in peer[1]:
                try:
                    shm.close()
                except BufferError:  # a tensor still views it; the OS reclaims it at exit
                    pass

    def close(self) -> None:
        for peer in self._peers.values():
            self._close_peer(peer)
        self.kv_caches = []
        for shm in self._segments:
            try:
                shm.close()
            except BufferError:
                pass
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        self._segments = []
