"""KVSender: moves a prefill worker's KV blocks to decode workers off the engine thread.

The engine thread only plans each step's writes: after a step it pins the blocks the step wrote
(``StepReport.pin``: they stay allocated whatever happens to the request) and queues a
``SendTask``. One thread per destination (decode engine) takes its tasks in order, waits for
the step's GPU work to complete (``ready``), writes the blocks (``KVTransferBackend.send``) and
unpins them. So a slow or stuck peer delays only the requests going to it; the engine keeps
prefilling; and a request's writes land in the order they were computed (a block a later chunk
fills further is written again by that chunk's task). A failed write fails its job, and the
job's later tasks are dropped (unpinned, not sent)."""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.common.errors import KVTransferError
from cluster.common.messages import PrefillRequest
from cluster.kv_transfer import KVTransferBackend
from cluster.kv_transfer.base import BlockCopy

logger = logging.getLogger(__name__)
_STOP = object()


@dataclass
class PrefillJob:
    """One request's writes. ``queued_upto`` (engine thread) is how far writes are queued;
    ``bytes_sent`` and ``transfer_s`` (sender thread) what the landed ones moved and took.
    ``landed`` completes when the last write has landed, or with the error that stopped them."""

    prefill: PrefillRequest
    #: The engine's id of the request's computing sample.
    request_id: str
    queued_upto: int
    bytes_sent: int = 0
    transfer_s: float = 0.0
    cancelled: bool = False
    error: Exception | None = None
    landed: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)

    def fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        try:
            self.landed.set_exception(error)
        except concurrent.futures.InvalidStateError:  # done already, or its waiter gave up
            pass

    def succeed(self) -> None:
        try:
            self.landed.set_result(None)
        except concurrent.futures.InvalidStateError:  # its waiter gave up (cancelled it)
            pass


@dataclass
class SendTask:
    job: PrefillJob
    copies: list[BlockCopy]
    last: bool
    #: Block tables pinned for this task (unpinned once it is done or dropped).
    pinned: list[list[int]]
    #: The step's completion event (torch.cuda.Event) or None on a CPU.
    ready: Any = None


class KVSender:
    def __init__(self, backend: KVTransferBackend, unpin: Callable[[list[list[int]]], None],
                 on_failed: Callable[[PrefillJob, KVTransferError], None],
                 on_landed: Callable[[PrefillJob], None]) -> None:
        self.backend = backend
        self._unpin = unpin
        self._on_failed = on_failed
        self._on_landed = on_landed
        self._queues: dict[str, queue.Queue[Any]] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, task: SendTask) -> None:
        """Queue a write (engine thread); it runs after the earlier writes to the same peer."""
        dest = task.job.prefill.dest.engine_id
        with self._lock:
            if self._closed:
                q = None
            else:
                q = self._queues.get(dest)
                if q is None:
                    q = self._queues[dest] = queue.Queue()
                    thread = threading.Thread(target=self._run, args=(q,), name=f"kv-send-{dest}", daemon=True)
                    self._threads.append(thread)
                    thread.start()
        if q is None:
            self._drop(task, KVTransferError("the prefill worker is shutting down"))
            return
        q.put(task)

    def queued(self) -> int:
        """Writes waiting or running, over all peers."""
        with self._lock:
            return sum(q.unfinished_tasks for q in self._queues.values())

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the sender threads once their queued writes are done (or dropped)."""
        with self._lock:
            self._closed = True
            queues, threads = list(self._queues.values()), list(self._threads)
        for q in queues:
            q.put(_STOP)
        for thread in threads:
            thread.join(timeout_s)

    # --- the sender threads ---------------------------------------------------------------------------

    def _run(self, q: queue.Queue[Any]) -> None:
        while True:
            task = q.get()
            try:
                if task is _STOP:
                    return
                self._send(task)
            except Exception:  # noqa: BLE001 - a bug in one task must not stop this peer's writes
                logger.exception("KV sender task failed")
                task.job.fail(KVTransferError("the KV sender failed"))
            finally:
                q.task_done()

    def _send(self, task: SendTask) -> None:
        job = task.job
        if job.cancelled or job.error is not None:  # the request ended, or an earlier write failed
            self._unpin(task.pinned)
            return
        error: KVTransferError | None = None
        try:
            if task.ready is not None:
                task.ready.synchronize()  # the step that wrote these blocks has finished on the device
            start = time.perf_counter()
            moved = self.backend.send(job.prefill.dest, job.prefill.transfer_key, task.copies, task.last)
            job.bytes_sent += moved
            job.transfer_s += time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - one request's bad write fails it, not the sender
            error = exc if isinstance(exc, KVTransferError) else KVTransferError(
                f"KV write for {job.prefill.transfer_key} failed: {exc!r}")
            logger.warning("KV write for %s failed: %s", job.prefill.transfer_key, error)
        finally:
            self._unpin(task.pinned)  # before the job's waiter hears of it, so it releases after
        if error is not None:
            job.fail(error)
            self._on_failed(job, error)
        elif task.last:
            self._on_landed(job)
            job.succeed()

    def _drop(self, task: SendTask, error: KVTransferError) -> None:
        task.job.fail(error)
        self._unpin(task.pinned)
