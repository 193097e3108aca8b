"""SampleStreams: runs the streams of one HTTP request (each prompt is one ``EngineClient.generate``
call, which streams its ``n`` samples) concurrently and merges their outputs in arrival order,
numbered as the response's choices: sample ``s`` of request ``r`` is choice ``offset(r) + s``.

Each prompt has a pump task that reads its iterator into one queue. Closing the merger (client
disconnect, an error, the end) cancels every pump, which throws CancelledError into the engine
client's iterator where it is waiting, so the engine aborts the sample; the pump then closes the
iterator. Cancellation is requested synchronously, so it takes effect even when the caller is
itself being cancelled. An iterator that raises puts its exception in the queue for the caller.

The merger also enforces the request's deadline as a backstop (the engine aborts a sample at its
deadline; if nothing ends it ``grace_s`` later, the merger raises RequestTimeoutError).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from cluster.api.client import EngineClient
from cluster.api.metrics import ServerMetrics
from cluster.common.errors import ClusterError, RequestTimeoutError
from cluster.common.messages import GenerateRequest, StepOutput

logger = logging.getLogger(__name__)

#: Seconds past a request's deadline after which the front end stops waiting for the engine.
DEADLINE_GRACE_S = 1.0


class _StreamEnded:
    """Queue marker: a sample's iterator is exhausted."""


class SampleStreams:
    def __init__(self, client: EngineClient, requests: list[GenerateRequest], metrics: ServerMetrics,
                 deadline_s: float | None = None, grace_s: float | None = None) -> None:
        self._client = client
        self._requests = requests
        self._metrics = metrics
        self._queue: asyncio.Queue[tuple[int, StepOutput | BaseException | _StreamEnded]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        sizes = [r.sampling_params.n for r in requests]
        #: The choice number of each request's first sample.
        self._offsets = [sum(sizes[:i]) for i in range(len(requests))]
        self._timers = [metrics.sample_timer() for _ in range(sum(sizes))]
        self._finished = [False] * sum(sizes)
        grace = DEADLINE_GRACE_S if grace_s is None else grace_s
        self._deadline = None if deadline_s is None else time.monotonic() + deadline_s + grace
        self._closed = False

    async def __aenter__(self) -> SampleStreams:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def start(self) -> None:
        for index, request in enumerate(self._requests):
            self._tasks.append(asyncio.create_task(self._pump(index, request), name=f"prompt-{request.request_id}"))

    @property
    def done(self) -> bool:
        return all(self._finished)

    async def _pump(self, index: int, request: GenerateRequest) -> None:
        first, count = self._offsets[index], request.sampling_params.n
        unfinished = set(range(first, first + count))
        iterator = self._client.generate(request)
        try:
            while unfinished:
                try:
                    out = await iterator.__anext__()
                except StopAsyncIteration:
                    self._queue.put_nowait((min(unfinished), _StreamEnded()))
                    return
                choice = first + out.sample_index - request.sample_index
                if choice not in unfinished:
                    raise ClusterError(f"request {request.request_id} streamed an output for sample "
                                       f"{out.sample_index}, which is not one of its unfinished samples")
                self._timers[choice].on_output(out)
                if out.finished:
                    unfinished.discard(choice)
                self._queue.put_nowait((choice, out))
        except asyncio.CancelledError:
            for choice in unfinished:
                self._timers[choice].finish("abort")
            raise
        except Exception as exc:  # handed to the request's handler, which maps it to a status
            for choice in unfinished:
                self._timers[choice].finish("error")
            self._queue.put_nowait((min(unfinished) if unfinished else first, exc))
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    def timings(self, choice: int, received: float) -> dict[str, float]:
        """Where choice ``choice``'s time went, for a request received at ``received``
        (``SampleTimer.timings``)."""
        return self._timers[choice].timings(received)

    async def next(self) -> tuple[int, StepOutput]:
        """The next output of any sample; raises what a sample's iterator raised, or
        RequestTimeoutError past the deadline. Call only while not ``done``."""
        timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        try:
            index, item = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            raise RequestTimeoutError("deadline exceeded", code="deadline_exceeded") from None
        if isinstance(item, _StreamEnded):
            raise ClusterError(f"sample {index} of the request ended without finishing")
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self._finished[index] = True
        return index, item

    async def __aiter__(self) -> AsyncIterator[tuple[int, StepOutput]]:
        while not self.done:
            yield await self.next()

    async def aclose(self) -> None:
        """Cancel every sample still running and wait (briefly) for their iterators to close."""
        if self._closed:
            return
        self._closed = True
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            # Shielded: when the caller is itself being cancelled, the pumps still get to close
            # their iterators (the cancel above already reached them).
            try:
                await asyncio.shield(asyncio.gather(*pending, return_exceptions=True))
            except asyncio.CancelledError:
                logger.debug("closing %d sample streams: caller cancelled", len(pending))
                raise
