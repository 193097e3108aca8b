"""Request lifecycles of the prefill and decode roles as code: each state an enum member, the legal
transitions a table, one record per request that refuses an illegal move, and a count of the
requests in each state (a gauge per state in /metrics).

Decode worker (one record per request, whatever its ``n``)::

    WAITING_FOR_BLOCKS -> REMOTE_PREFILL -> RECEIVING -> DECODING -> DONE
            |                   |               |
            |                   +---------------+--> LOCAL_PREFILL -> DECODING   (fallback)
    LOCAL_PREFILL (short prompts, no prefill worker) -> DECODING
    any state -> FAILED -> DONE, or -> DONE (finished, cancelled)

Prefill worker (chunks are computed in PREFILLING while earlier chunks' writes may be in flight;
SENDING: the whole prompt is computed, writes still in flight; SENT: the last write has landed)::

    QUEUED -> PREFILLING -> SENDING -> SENT -> RELEASED
    QUEUED | PREFILLING | SENDING -> FAILED -> RELEASED;  any state -> RELEASED (cancelled)
"""
from __future__ import annotations

import enum
import threading
import time
from collections import Counter
from typing import Generic, TypeVar


class DecodeState(str, enum.Enum):
    WAITING_FOR_BLOCKS = "waiting_for_blocks"
    REMOTE_PREFILL = "remote_prefill"
    RECEIVING = "receiving"
    LOCAL_PREFILL = "local_prefill"
    DECODING = "decoding"
    FAILED = "failed"
    DONE = "done"


class PrefillState(str, enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    SENDING = "sending"
    SENT = "sent"
    FAILED = "failed"
    RELEASED = "released"


_D = DecodeState
DECODE_TRANSITIONS: dict[DecodeState, frozenset[DecodeState]] = {
    _D.WAITING_FOR_BLOCKS: frozenset({_D.REMOTE_PREFILL, _D.FAILED, _D.DONE}),
    _D.REMOTE_PREFILL: frozenset({_D.RECEIVING, _D.LOCAL_PREFILL, _D.FAILED, _D.DONE}),
    _D.RECEIVING: frozenset({_D.DECODING, _D.LOCAL_PREFILL, _D.FAILED, _D.DONE}),
    _D.LOCAL_PREFILL: frozenset({_D.DECODING, _D.FAILED, _D.DONE}),
    _D.DECODING: frozenset({_D.FAILED, _D.DONE}),
    _D.FAILED: frozenset({_D.DONE}),
    _D.DONE: frozenset(),
}
_P = PrefillState
PREFILL_TRANSITIONS: dict[PrefillState, frozenset[PrefillState]] = {
    _P.QUEUED: frozenset({_P.PREFILLING, _P.FAILED, _P.RELEASED}),
    _P.PREFILLING: frozenset({_P.SENDING, _P.FAILED, _P.RELEASED}),
    _P.SENDING: frozenset({_P.SENT, _P.FAILED, _P.RELEASED}),
    _P.SENT: frozenset({_P.RELEASED}),
    _P.FAILED: frozenset({_P.RELEASED}),
    _P.RELEASED: frozenset(),
}

S = TypeVar("S", DecodeState, PrefillState)


class IllegalTransition(RuntimeError):
    """A request was moved between states its lifecycle does not connect (a bug)."""


class Lifecycles(Generic[S]):
    """A role's request records: each request's state, when it entered it and until when it may
    stay there (its deadline in that state), and how many requests are in each state. Safe to
    use from several threads (the prefill worker moves its records from the engine thread)."""

    def __init__(self, transitions: dict[S, frozenset[S]], final: S) -> None:
        self.transitions = transitions
        self.final = final
        self._lock = threading.Lock()
        self._records: dict[str, tuple[S, float, float | None]] = {}
        self._counts: Counter[S] = Counter()
        #: Set to a list to record every move as (request id, from, to) (tests).
        self.history: list[tuple[str, S | None, S]] | None = None

    def start(self, request_id: str, state: S, deadline: float | None = None) -> None:
        with self._lock:
            if request_id in self._records:
                raise IllegalTransition(f"{request_id}: already has a record")
            self._records[request_id] = (state, time.monotonic(), deadline)
            self._counts[state] += 1
            if self.history is not None:
                self.history.append((request_id, None, state))

    def move(self, request_id: str, state: S, deadline: float | None = None) -> bool:
        """Move to ``state`` (its own ``deadline``, a monotonic time, or None); the final state
        drops the record. False, moving nothing, if the record has already ended (the request
        was cancelled meanwhile); an illegal move raises IllegalTransition."""
        with self._lock:
            record = self._records.get(request_id)
            if record is None:
                return False
            current = record[0]
            if state not in self.transitions[current]:
                raise IllegalTransition(f"{request_id}: {current.value} -> {state.value} is not a legal move")
            self._counts[current] -= 1
            if self.history is not None:
                self.history.append((request_id, current, state))
            if state == self.final:
                del self._records[request_id]
            else:
                self._records[request_id] = (state, time.monotonic(), deadline)
                self._counts[state] += 1
            return True

    def advance(self, request_id: str, expected: S, state: S, deadline: float | None = None) -> bool:
        """Move to ``state`` only if the request is in ``expected`` now (a task that races with
        the request's ending: whichever moves first wins, the other moves nothing)."""
        with self._lock:
            record = self._records.get(request_id)
            if record is None or record[0] != expected:
                return False
        return self.move(request_id, state, deadline)

    def end(self, request_id: str) -> None:
        """Move to the final state if the request still has a record (idempotent)."""
        self.move(request_id, self.final)

    def state(self, request_id: str) -> S | None:
        with self._lock:
            record = self._records.get(request_id)
        return None if record is None else record[0]

    def overdue(self, now: float | None = None) -> list[tuple[str, S]]:
        """Records past their deadline in their state (a stuck request: the tests require none)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return [(rid, s) for rid, (s, _, d) in self._records.items() if d is not None and now > d]

    def counts(self) -> dict[S, int]:
        """Requests in each non-final state (zero included)."""
        with self._lock:
            return {s: self._counts[s] for s in self.transitions if s != self.final}

    def gauges(self, prefix: str) -> dict[str, float]:
        """ReplicaStats extras: ``<prefix>_<state>`` -> requests in that state."""
        gauges = {f"{prefix}_{s.value}": float(n) for s, n in self.counts().items()}
        gauges[f"{prefix}_overdue"] = float(len(self.overdue()))
        return gauges
