"""``nccl``: torch.distributed point-to-point between each prefill/decode pair (NCCL between
GPUs, Gloo between CPU processes), one two-rank process group per pair.

Pairing: the receiver hosts a TCPStore; a sender takes the next pair number from it
(``store.add``), announces itself under ``pair/<k>``, and both build a process group on the
prefix ``pg/<k>`` (receiver rank 0, sender rank 1). The receiver runs one thread per pair that
receives messages and copies their blocks into its KV storage. A message is a header
``[kind, key_len, num_groups, last]``, the request key's bytes, then per group ``[group, count]``,
the destination block ids and the blocks' bytes. NCCL cannot pair two ranks on one GPU: on a
single GPU use ``ipc``.

The sender announces each message in the store (the counter ``msg/<k>``) before its first send,
and the receiver posts receives only for announced messages: an idle pair has no receive
outstanding. (A receive left waiting is a kernel spinning on the receiver's GPU, and NCCL's
watchdog aborts the whole process once it has waited ``timeout_s``: an idle minute between a
prefill and a decode worker would kill the decode worker.) The receiver polls the counter, every
0.2 ms right after a message and backing off to every 2 ms when idle."""
from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from cluster.common.errors import KVTransferError
from cluster.common.kv_spec import KVGroupSpec
from cluster.kv_transfer.base import BlockCopy, KVTransferBackend, PeerCache, TransferEndpoint, index_tensor, rows

logger = logging.getLogger(__name__)
_DATA, _BYE = 1, 2
_POLL_MIN_S, _POLL_MAX_S = 0.0002, 0.002


def _make_group(store: Any, rank: int, device: torch.device, timeout_s: float) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


class NCCLBackend(KVTransferBackend):
    name = "nccl"

    def __init__(self, kv_caches: list[torch.Tensor], specs: list[KVGroupSpec], engine_id: str,
                 node_id: str = "", host: str | None = None, timeout_s: float = 60.0) -> None:
        super().__init__(kv_caches, specs, engine_id, node_id)
        self.device = kv_caches[0].device
        self.timeout_s = timeout_s
        self.host = host or "127.0.0.1"
        self._store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self._received: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._peers = PeerCache()
        #: One lock per receiver: each pair's messages go out whole and in order, and a slow
        #: pair does not hold up the others' sending threads.
        self._send_locks: dict[str, threading.Lock] = {}
        threading.Thread(target=self._accept, name="kv-accept", daemon=True).start()

    def _endpoint_info(self) -> dict[str, Any]:
        return {"host": self.host, "port": self._store.port}

    # --- receiver --------------------------------------------------------------------------------

    def _accept(self) -> None:
        k = 0
        while not self._closed.is_set():
            if not self._store.check([f"pair/{k}"]):  # polled: a blocking wait logs every timeout
                time.sleep(0.02)
                continue
            try:
                group = _make_group(dist.PrefixStore(f"pg/{k}", self._store), 0, self.device, self.timeout_s)
            except Exception:  # noqa: BLE001 - a sender that died while pairing
                logger.exception("pairing %d failed", k)
                k += 1
                continue
            threading.Thread(target=self._receive_loop, args=(group, k), name=f"kv-recv-{k}", daemon=True).start()
            k += 1

    def _receive_loop(self, group: Any, pair: int) -> None:
        storage_rows = [rows(t) for t in self.kv_caches]
        # this thread's own client of the store (the master object stays with the accept thread)
        store = dist.TCPStore(self.host, self._store.port, is_master=False,
                              timeout=datetime.timedelta(seconds=self.timeout_s))
        announced, done, pause = f"msg/{pair}", 0, _POLL_MIN_S
        while not self._closed.is_set():
            try:
                if store.add(announced, 0) <= done:  # nothing announced: no receive posted
                    time.sleep(pause)
                    pause = min(2 * pause, _POLL_MAX_S)
                    continue
                done, pause = done + 1, _POLL_MIN_S
                header = torch.zeros(4, dtype=torch.int64, device=self.device)
                group.recv([header], 1, 0).wait()
                kind, key_len, num_groups, last = header.tolist()
                if kind == _BYE:
                    return
                key_bytes = torch.zeros(key_len, dtype=torch.uint8, device=self.device)
                group.recv([key_bytes], 1, 0).wait()
                key = bytes(key_bytes.cpu().tolist()).decode()
                for _ in range(num_groups):
                    meta = torch.zeros(2, dtype=torch.int64, device=self.device)
                    group.recv([meta], 1, 0).wait()
                    g, count = meta.tolist()
                    ids = torch.zeros(count, dtype=torch.int64, device=self.device)
                    group.recv([ids], 1, 0).wait()
                    data = torch.empty((count, storage_rows[g].shape[1]), dtype=torch.uint8, device=self.device)
                    group.recv([data], 1, 0).wait()
                    storage_rows[g].index_copy_(0, ids, data)
                if last:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    self._event(key).set()
            except Exception:  # noqa: BLE001 - the sender went away; its requests time out
                if not self._closed.is_set():
                    logger.warning("KV receive loop for pair %d ended", pair, exc_info=True)
                return

    def _event(self, key: str) -> threading.Event:
        with self._lock:
            return self._received.setdefault(key, threading.Event())

    def wait_received(self, request_key: str, timeout_s: float, sender_node: str | None = None) -> None:
        if not self._event(request_key).wait(timeout_s):
            raise KVTransferError(f"KV for request {request_key} did not arrive within {timeout_s:.1f}s")
        self.forget(request_key)

    def forget(self, request_key: str) -> None:
        with self._lock:
            self._received.pop(request_key, None)

    # --- sender ------------------------------------------------------------------------------------

    def _connect(self, dest: TransferEndpoint) -> Any:
        store = dist.TCPStore(dest.info["host"], dest.info["port"], is_master=False,
                              timeout=datetime.timedelta(seconds=self.timeout_s))
        k = store.add("pairs", 1) - 1
        store.set(f"pair/{k}", self.engine_id)
        return _make_group(dist.PrefixStore(f"pg/{k}", store), 1, self.device, self.timeout_s), store, k

    def _peer_lock(self, engine_id: str) -> threading.Lock:
        with self._lock:
            return self._send_locks.setdefault(engine_id, threading.Lock())

    def _send(self, dest: TransferEndpoint, request_key: str, copies: list[BlockCopy], last: bool) -> int:
        with self._peer_lock(dest.engine_id):
            group, store, k = self._peers.get(dest, self._connect)
            key = torch.tensor(list(request_key.encode()), dtype=torch.uint8, device=self.device)
            header = torch.tensor([_DATA, key.numel(), len(copies), int(last)], dtype=torch.int64, device=self.device)
            store.add(f"msg/{k}", 1)  # announce: the receiver posts its receives now
            group.send([header], 0, 0).wait()
            group.send([key], 0, 0).wait()
            storage_rows = [rows(t) for t in self.kv_caches]
            for c in copies:
                group.send([torch.tensor([c.group, c.num_blocks], dtype=torch.int64, device=self.device)], 0, 0).wait()
                group.send([index_tensor(c.dst, self.device)], 0, 0).wait()
                data = storage_rows[c.group].index_select(0, index_tensor(c.src, self.device))
                group.send([data], 0, 0).wait()
        return self.block_bytes(copies)

    def _drop_peer(self, dest: TransferEndpoint) -> None:
        self._peers.drop(dest.engine_id)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            locks = list(self._send_locks.values())
        for lock in locks:
            lock.acquire()
        try:
            for group, store, k in self._peers.values():
                try:
                    bye = torch.tensor([_BYE, 0, 0, 0], dtype=torch.int64, device=self.device)
                    store.add(f"msg/{k}", 1)
                    group.send([bye], 0, 0).wait()
                except Exception:  # noqa: BLE001 - the receiver is gone already
                    pass
        finally:
            for lock in locks:
                lock.release()

