"""AsyncEngine under callers that go away: a call cancelled while it waits for the engine thread
is skipped there (and never kills the loop by completing a cancelled future), a request whose
caller is cancelled while it is being added is aborted rather than left running for nobody, and
outputs for a caller whose event loop has closed abort that request instead of the loop."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from cluster.engine.async_engine import AsyncEngine


class FakeEngine:
    """Just what AsyncEngine's loop touches: no work, commands only."""

    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(has_work=lambda: False)
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.add_gate: threading.Event | None = None
        self.adding = threading.Event()
        self.pending: list = []

    def take_pending(self) -> list:
        out, self.pending = self.pending, []
        return out

    def has_work(self) -> bool:
        return False

    def add_group(self, group) -> None:
        self.adding.set()
        if self.add_gate is not None:
            self.add_gate.wait(5)
        self.added.append(group.request_id)

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_call_cancelled_while_queued_is_skipped_and_the_loop_lives():
    engine = FakeEngine()
    ae = AsyncEngine(engine)  # type: ignore[arg-type]
    gate, ran = threading.Event(), []

    async def main() -> None:
        blocker = asyncio.ensure_future(ae.run(lambda e: gate.wait(5)))  # holds the engine thread
        await asyncio.sleep(0.05)
        victims = [asyncio.ensure_future(ae.run(lambda e, i=i: ran.append(i))) for i in range(3)]
        await asyncio.sleep(0.05)
        for v in victims:
            v.cancel()
        # the cancellations reach the engine's futures before the engine thread is released
        await asyncio.gather(*victims, return_exceptions=True)
        gate.set()
        assert await blocker is True
        assert await asyncio.wait_for(ae.run(lambda e: 42), 5) == 42

    try:
        asyncio.run(main())
        assert ae.dead is None
        assert ran == []  # their callers were gone before the engine thread reached them
    finally:
        ae.shutdown()


def test_a_request_whose_caller_is_cancelled_while_being_added_is_aborted():
    engine = FakeEngine()
    engine.add_gate = threading.Event()
    ae = AsyncEngine(engine)  # type: ignore[arg-type]

    async def main() -> None:
        async def consume() -> None:
            async for _ in ae.generate(SimpleNamespace(request_id="r1")):  # type: ignore[arg-type]
                pass
        task = asyncio.ensure_future(consume())
        while not engine.adding.is_set():  # until add_group runs in the engine thread
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        engine.add_gate.set()

    try:
        asyncio.run(main())
        wait_for(lambda: engine.aborted == ["r1"])
        assert engine.added == ["r1"] and ae.dead is None
        assert "r1" not in ae._streams
    finally:
        ae.shutdown()


def test_outputs_for_a_closed_event_loop_abort_their_request_only():
    engine = FakeEngine()
    ae = AsyncEngine(engine)  # type: ignore[arg-type]

    async def register() -> None:
        ae.open_stream("gone")
    try:
        asyncio.run(register())  # that loop is closed now, with the stream still registered
        ae.submit(lambda e: e.pending.append(SimpleNamespace(request_id="gone", finished=False)))
        wait_for(lambda: engine.aborted == ["gone"])
        assert ae.dead is None and "gone" not in ae._streams

        async def still_serving() -> int:
            return await ae.run(lambda e: 7)
        assert asyncio.run(still_serving()) == 7
    finally:
        ae.shutdown()
