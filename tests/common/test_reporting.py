"""The stats reporter outlives every failure but its own cancellation: a report that raises, one
cancelled from outside (a state replica going away) and one that hangs are each followed by
later reports."""
from __future__ import annotations

import asyncio

import pytest

from cluster.common import reporting


class FlakyState:
    """A ClusterState handle whose first reports raise, are cancelled, hang; later ones arrive."""

    def __init__(self) -> None:
        self.calls = 0
        self.received: list[int] = []
        self.report = self

    def remote(self, stats, backends):
        self.calls += 1
        return self._call(self.calls, stats)

    async def _call(self, n: int, stats) -> None:
        if n == 1:
            raise RuntimeError("state replica unreachable")
        if n == 2:
            raise asyncio.CancelledError()  # the request was cancelled by the other side
        if n == 3:
            await asyncio.sleep(3600)  # never answers
        self.received.append(stats)


def test_reporter_survives_errors_cancelled_and_hung_reports(monkeypatch, caplog):
    monkeypatch.setattr(reporting, "_REPORT_TIMEOUT_S", 0.2)
    state = FlakyState()
    counter = iter(range(1000))

    async def stats() -> int:
        return next(counter)

    async def main() -> None:
        task = asyncio.ensure_future(reporting.report_forever(state, stats, lambda: [], period_s=0.01))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if len(state.received) >= 3:
                break
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert len(state.received) >= 3 and state.received == sorted(state.received)
    assert "stats report failed" in caplog.text


def test_an_idle_replica_reports_only_a_heartbeat():
    """Unchanged stats are sent again only every heartbeat; a change is sent at the next period."""
    from cluster.common.messages import ReplicaStats

    class State:
        def __init__(self) -> None:
            self.received: list[ReplicaStats] = []
            self.report = self

        def remote(self, stats, backends):
            self.received.append(stats)

            async def done() -> None:
                return None
            return done()
    state = State()
    running = [0]

    async def stats() -> ReplicaStats:
        return ReplicaStats(role="decode", replica_id="d0", num_requests_running=running[0])

    async def main() -> None:
        task = asyncio.ensure_future(reporting.report_forever(state, stats, lambda: [], period_s=0.02,
                                                              heartbeat_s=0.3))
        await asyncio.sleep(0.7)  # idle: the first report, then a heartbeat about every 0.3 s
        idle = len(state.received)
        running[0] = 5
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert 2 <= idle <= 4  # not 35 (one per period)
        assert state.received[-1].num_requests_running == 5 and len(state.received) <= idle + 2
    asyncio.run(main())
