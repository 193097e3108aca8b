"""AsyncEngine: drives an LLMEngine's step loop in its own thread for asyncio callers.

Every engine call runs in that thread between steps (``await run(fn)``), so the engine stays
single-threaded. Outputs reach callers through per-request asyncio queues. An optional
``post_step`` hook runs in the engine thread right after each step, before outputs are
delivered (the prefill role pushes the step's KV blocks there, while they are certainly valid).
If the loop dies, every waiting caller gets EngineDeadError; nothing hangs. A caller cancelled
before the engine thread reaches its command (a client disconnect) has the command skipped; one
cancelled while its request was being added has that request aborted."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from cluster.common.errors import ClusterError, EngineDeadError
from cluster.common.outputs import RequestOutput
from cluster.engine.engine import LLMEngine
from cluster.engine.output_processor import RequestGroup

logger = logging.getLogger(__name__)
T = TypeVar("T")
_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, post_step: Callable[[LLMEngine], None] | None = None,
                 idle_wait_s: float = 0.02) -> None:
        self.engine = engine
        self.post_step = post_step
        self.idle_wait_s = idle_wait_s
        self._commands: queue.Queue[Any] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._lock = threading.Lock()
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # --- calls into the engine thread ----------------------------------------------------------

    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` in the engine thread between steps and return its result."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self.dead}")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Fire and forget (safe from any thread, e.g. cancellation paths)."""
        self._commands.put((fn, None))

    def open_stream(self, request_id: str) -> asyncio.Queue[Any]:
        """Register for a request's outputs before it starts producing them."""
        q: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close_stream(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    async def read_stream(self, request_id: str, q: asyncio.Queue[Any]) -> AsyncIterator[RequestOutput]:
        """Yield a request's outputs until it finishes; abort it if the caller stops early."""
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self.close_stream(request_id)
            if not finished:
                self.submit(lambda e: e.abort_request(request_id))

    async def generate(self, group: RequestGroup) -> AsyncIterator[RequestOutput]:
        """Add a request and stream its outputs (RequestOutput deltas, the last finished)."""
        q = self.open_stream(group.request_id)
        try:
            await self.run(lambda e: e.add_group(group))
        except BaseException:
            self.close_stream(group.request_id)
            # Cancelled while the engine thread was adding it: the request exists there now and
            # nobody reads it (aborting an unknown request is a no-op).
            self.submit(lambda e: e.abort_request(group.request_id))
            raise
        async for out in self.read_stream(group.request_id, q):
            yield out

    def shutdown(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=10)

    # --- the loop ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                busy = self.engine.scheduler.has_work()
                if not self._drain(block=not busy):
                    return
                self._deliver(self.engine.take_pending())
                if self.engine.has_work():
                    outputs = self.engine.step()
                    if self.post_step is not None:
                        self.post_step(self.engine)
                    self._deliver(outputs)
        except BaseException as exc:  # noqa: BLE001 - report to every waiter, then stop
            logger.exception("engine loop died")
            self.dead = exc
            self._fail_everyone(exc)

    def _drain(self, block: bool) -> bool:
        """Run queued commands; wait a little for one when idle. False: shut down."""
        try:
            item = self._commands.get(timeout=self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                return False
            fn, future = item
            # A caller cancelled while its command waited here is gone: skip the command (and
            # never complete its cancelled future, which would raise in this thread).
            if future is None or future.set_running_or_notify_cancel():
                try:
                    result = fn(self.engine)
                except BaseException as exc:  # noqa: BLE001 - a failed command fails its caller only
                    if future is not None:
                        future.set_exception(exc)
                    elif not isinstance(exc, ClusterError):
                        logger.exception("engine command failed")
                else:
                    if future is not None:
                        future.set_result(result)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._streams.get(out.request_id), out) for out in outputs]
        for target, out in targets:
            if target is not None:
                loop, q = target
                try:
                    loop.call_soon_threadsafe(q.put_nowait, out)
                except RuntimeError:  # the caller's event loop is closed: nobody will read this
                    self.close_stream(out.request_id)
                    if not out.finished:
                        self.engine.abort_request(out.request_id)

    def _fail_everyone(self, exc: BaseException) -> None:
        error = EngineDeadError(f"engine loop stopped: {exc}")
        with self._lock:
            streams = list(self._streams.values())
        for loop, q in streams:
            try:
                loop.call_soon_threadsafe(q.put_nowait, error)
            except RuntimeError:  # that caller's event loop is closed
                pass
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP and item[1] is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(error)
