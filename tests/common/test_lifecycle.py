"""The roles' request lifecycles: legal moves only, counts per state, per-state deadlines."""
from __future__ import annotations

import time

import pytest

from cluster.common.lifecycle import (DECODE_TRANSITIONS, PREFILL_TRANSITIONS, DecodeState, IllegalTransition,
                                      Lifecycles, PrefillState)


def test_decode_lifecycle_moves_and_counts():
    lc = Lifecycles(DECODE_TRANSITIONS, DecodeState.DONE)
    lc.start("a", DecodeState.WAITING_FOR_BLOCKS)
    lc.start("b", DecodeState.LOCAL_PREFILL)
    assert lc.counts()[DecodeState.WAITING_FOR_BLOCKS] == 1 and lc.counts()[DecodeState.LOCAL_PREFILL] == 1
    for state in (DecodeState.REMOTE_PREFILL, DecodeState.RECEIVING, DecodeState.DECODING):
        assert lc.move("a", state)
    assert lc.state("a") is DecodeState.DECODING
    with pytest.raises(IllegalTransition):
        lc.move("a", DecodeState.RECEIVING)  # decoding never goes back to receiving
    with pytest.raises(IllegalTransition):
        lc.move("b", DecodeState.REMOTE_PREFILL)  # a local prefill is never sent away
    with pytest.raises(IllegalTransition):
        lc.start("a", DecodeState.LOCAL_PREFILL)  # one record per request
    assert not lc.advance("a", DecodeState.RECEIVING, DecodeState.DECODING)  # not in RECEIVING: no move
    lc.end("a")
    lc.end("a")  # idempotent
    assert not lc.move("a", DecodeState.FAILED)  # gone: nothing moves
    lc.move("b", DecodeState.FAILED)
    lc.end("b")
    assert not any(lc.counts().values())
    assert DecodeState.DONE not in lc.counts()


def test_prefill_lifecycle_and_gauges():
    lc = Lifecycles(PREFILL_TRANSITIONS, PrefillState.RELEASED)
    lc.history = []
    lc.start("p", PrefillState.QUEUED)
    lc.move("p", PrefillState.PREFILLING)
    with pytest.raises(IllegalTransition):
        lc.move("p", PrefillState.QUEUED)
    with pytest.raises(IllegalTransition):
        lc.move("p", PrefillState.SENT)  # the writes are in flight first
    lc.move("p", PrefillState.SENDING)
    lc.move("p", PrefillState.SENT)
    with pytest.raises(IllegalTransition):
        lc.move("p", PrefillState.FAILED)  # sent is sent
    gauges = lc.gauges("prefill_requests")
    assert gauges["prefill_requests_sent"] == 1.0 and gauges["prefill_requests_queued"] == 0.0
    lc.end("p")
    assert [(a, b) for _, a, b in lc.history] == [
        (None, PrefillState.QUEUED), (PrefillState.QUEUED, PrefillState.PREFILLING),
        (PrefillState.PREFILLING, PrefillState.SENDING), (PrefillState.SENDING, PrefillState.SENT),
        (PrefillState.SENT, PrefillState.RELEASED)]
    # every state reaches the final one
    for transitions, final in ((DECODE_TRANSITIONS, DecodeState.DONE), (PREFILL_TRANSITIONS, PrefillState.RELEASED)):
        for state, nexts in transitions.items():
            assert state == final or final in nexts or (nexts and all(final in transitions[n] for n in nexts))


def test_a_record_past_its_deadline_in_a_state_is_overdue():
    lc = Lifecycles(DECODE_TRANSITIONS, DecodeState.DONE)
    lc.start("slow", DecodeState.WAITING_FOR_BLOCKS, deadline=time.monotonic() + 0.05)
    lc.start("fine", DecodeState.WAITING_FOR_BLOCKS)
    assert lc.overdue() == []
    time.sleep(0.08)
    assert lc.overdue() == [("slow", DecodeState.WAITING_FOR_BLOCKS)]
    assert lc.gauges("decode_requests")["decode_requests_overdue"] == 1.0
    lc.move("slow", DecodeState.REMOTE_PREFILL, deadline=time.monotonic() + 60)
    assert lc.overdue() == []
