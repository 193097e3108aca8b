"""Prefill and decode workers wired together in one process (local KV transfer): disaggregated
output equals colocated output token for token, failures fall back or fail cleanly, and every
block is returned on both sides."""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from cluster import LLM, SamplingParams
from cluster.common.lifecycle import DecodeState as D
from cluster.common.lifecycle import PrefillState as P
from cluster.common.messages import GenerateRequest
from cluster.config import parse_cluster_args
from cluster.decode.worker import DecodeWorker
from cluster.prefill.worker import PrefillWorker
from tests.factories import make_checkpoint, mixed_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    make_checkpoint(path, "llama")
    return path


def make_pair(model_dir: str, **settings):
    config = parse_cluster_args({"model": model_dir, "kv_transfer": "local", "block_size": 4,
                                 "max_num_batched_tokens": 16, **settings}, use_env=False)
    prefill = PrefillWorker(config, engine_id=f"p-{uuid.uuid4().hex[:6]}")
    decode = DecodeWorker(config, engine_id=f"d-{uuid.uuid4().hex[:6]}", prefill_fn=prefill.prefill)
    return prefill, decode


def decode_with_dying_prefill(model_dir: str, dies_after_s: float, **settings) -> DecodeWorker:
    """A decode worker whose every remote prefill fails after ``dies_after_s`` (the prefill
    replica died), with blocks of 4 tokens."""
    async def dying_prefill(request):
        await asyncio.sleep(dies_after_s)
        raise ConnectionError("prefill replica died")
    config = parse_cluster_args({"model": model_dir, "kv_transfer": "local", "block_size": 4,
                                 "max_num_batched_tokens": 64, **settings}, use_env=False)
    return DecodeWorker(config, engine_id=f"d-{uuid.uuid4().hex[:6]}", prefill_fn=dying_prefill)


def wait_blocks_back(decode: DecodeWorker, timeout: float = 5.0) -> None:
    """Until every block is free again (quarantined reservations come back after their grace)."""
    engine = decode.engine.engine
    deadline = time.monotonic() + timeout
    while engine.kv.usage > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.kv.usage == 0.0


async def collect(decode: DecodeWorker, req: GenerateRequest) -> list[int]:
    tokens: list[int] = []
    async for out in decode.generate(req):
        tokens += out.new_token_ids
        if out.error:
            raise RuntimeError(out.error)
    return tokens


async def run_all(decode, prompts, params, concurrency=8, local=False):
    sem = asyncio.Semaphore(concurrency)

    async def one(i, p):
        async with sem:
            return await collect(decode, GenerateRequest(f"r{i}", p, params, local_prefill=local))
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def paths(history) -> set[tuple]:
    """Each request's sequence of states, from a lifecycle's history."""
    by_request: dict[str, list] = {}
    for rid, _, state in history:
        by_request.setdefault(rid, []).append(state)
    return {tuple(states) for states in by_request.values()}


def prompts_with_shared_prefixes() -> list[list[int]]:
    base = mixed_prompts(300, (3, 5, 9, 13, 17, 22, 30, 41), seed=3)
    shared = base[-1]
    return base + [shared + p[:5] for p in base[:8]] + mixed_prompts(300, (7, 19, 26, 33), seed=4)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_disaggregated_equals_colocated(model_dir, sampling):
    params = (SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) if sampling == "greedy"
              else SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True))
    prompts = prompts_with_shared_prefixes()
    assert len(prompts) >= 20
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, block_size=4).generate(prompts, params)]
    prefill, decode = make_pair(model_dir)
    decode.lifecycle.history, prefill.lifecycle.history = [], []
    try:
        got = asyncio.run(run_all(decode, prompts, params))
        assert got == expected
        assert decode.backend.stats.count == 0 and prefill.backend.stats.count > 0
        assert decode.remote_prefill_failures == 0  # every prompt really went through the prefill worker
        assert decode.engine.engine.kv.usage == 0.0 and prefill.engine.engine.kv.usage == 0.0
        # every request went through each role's lifecycle, in order, and left no record
        assert paths(decode.lifecycle.history) == {(D.WAITING_FOR_BLOCKS, D.REMOTE_PREFILL, D.RECEIVING,
                                                    D.DECODING, D.DONE)}
        assert paths(prefill.lifecycle.history) == {(P.QUEUED, P.PREFILLING, P.SENDING, P.SENT, P.RELEASED)}
        assert not any(decode.lifecycle.counts().values()) and not any(prefill.lifecycle.counts().values())
    finally:
        prefill.shutdown()
        decode.shutdown()


async def collect_samples(decode: DecodeWorker, req: GenerateRequest) -> list[list[int]]:
    """Each sample's tokens, in sample order."""
    tokens: dict[int, list[int]] = {}
    async for out in decode.generate(req):
        if out.error:
            raise RuntimeError(out.error)
        tokens.setdefault(out.sample_index, []).extend(out.new_token_ids)
    return [tokens[i] for i in sorted(tokens)]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_n_samples_make_one_prefill_and_fork_on_decode(model_dir, sampling):
    """n samples of each prompt: the prefill worker computes each prompt once and draws every
    sample's first token; the decode worker forks sample 0's KV for the others and computes no
    prompt token itself; every sample equals colocated ``LLM.generate``."""
    n = 3
    params = (SamplingParams(n=n, temperature=0.0, max_tokens=6, ignore_eos=True) if sampling == "greedy"
              else SamplingParams(n=n, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True))
    prompts = mixed_prompts(300, (6, 13, 22, 37), seed=12)
    expected = [[c.token_ids for c in o.outputs] for o in LLM(model_dir, block_size=4).generate(prompts, params)]
    prefill, decode = make_pair(model_dir)
    try:
        async def go():
            return await asyncio.gather(*(collect_samples(decode, GenerateRequest(f"n{i}", p, params))
                                          for i, p in enumerate(prompts)))
        assert asyncio.run(go()) == expected
        assert prefill.prefills_completed == len(prompts)
        engine = decode.engine.engine
        assert engine.num_forked_samples == len(prompts) * (n - 1)
        assert engine.scheduler.prefix_queried_tokens == 0  # nothing was prefilled on decode
        assert decode.remote_prefill_failures == 0
        wait_blocks_back(decode)
        assert prefill.engine.engine.kv.usage == 0.0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_n_samples_fork_after_a_local_fallback_prefill(model_dir):
    """The remote prefill fails: decode prefills sample 0 itself and the others fork it."""
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    prompt = mixed_prompts(300, (21,), seed=13)[0]
    expected = [c.token_ids for c in LLM(model_dir, block_size=4).generate([prompt], params)[0].outputs]
    prefill, decode = make_pair(model_dir)
    try:
        prefill.backend.inject_failures = 1
        assert asyncio.run(collect_samples(decode, GenerateRequest("fb", prompt, params))) == expected
        assert decode.remote_prefill_failures == 1 and decode.engine.engine.num_forked_samples == 2
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_transfer_failure_falls_back_to_local_prefill(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = mixed_prompts(300, (21,), seed=9)[0]
    expected = LLM(model_dir, block_size=4).generate([prompt], params)[0].outputs[0].token_ids
    prefill, decode = make_pair(model_dir)
    decode.lifecycle.history = []
    try:
        prefill.backend.inject_failures = 1
        got = asyncio.run(collect(decode, GenerateRequest("f1", prompt, params)))
        assert got == expected and prefill.backend.stats.failures_total == 1
        assert decode.remote_prefill_failures == 1
        assert paths(decode.lifecycle.history) == {(D.WAITING_FOR_BLOCKS, D.REMOTE_PREFILL, D.LOCAL_PREFILL,
                                                    D.DECODING, D.DONE)}
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_transfer_failure_without_fallback_fails_cleanly(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prefill, decode = make_pair(model_dir, fallback_to_local_prefill=False, remote_kv_grace_s=0.1)
    decode.lifecycle.history = []
    try:
        prefill.backend.inject_failures = 1

        async def go():
            outs = [o async for o in decode.generate(GenerateRequest("f2", [5, 6, 7, 8, 9], params))]
            ok = await collect(decode, GenerateRequest("ok", [5, 6, 7], params))
            await asyncio.sleep(0.3)  # the abandoned reservation's grace period
            await decode.engine.call(lambda e: e.step())
            return outs, ok
        outs, ok = asyncio.run(go())
        assert outs[-1].finish_reason == "error" and "injected" in (outs[-1].error or "")
        assert len(ok) == 8  # the next request is served
        assert paths(decode.lifecycle.history) == {
            (D.WAITING_FOR_BLOCKS, D.REMOTE_PREFILL, D.FAILED, D.DONE),
            (D.WAITING_FOR_BLOCKS, D.REMOTE_PREFILL, D.RECEIVING, D.DECODING, D.DONE)}
        assert decode.engine.engine.kv.usage == 0.0 and prefill.engine.engine.kv.usage == 0.0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_conditional_disaggregation_prefills_short_prompts_locally(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prefill, decode = make_pair(model_dir)
    try:
        asyncio.run(run_all(decode, [[4, 5, 6]], params, local=True))
        assert prefill.backend.stats.count == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_callers_cancelled_at_any_moment_lose_nothing(model_dir):
    """Decode callers cancelled at random moments (before their first engine call is reached,
    while reserving, during the remote prefill, mid-decode) leave both engines alive with every
    block back, and later requests still match colocated output."""
    import random
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = mixed_prompts(300, (3, 9, 17, 26, 33, 41), seed=12)
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, block_size=4).generate(prompts, params)]
    prefill, decode = make_pair(model_dir, remote_kv_grace_s=0.1)
    rng = random.Random(3)
    try:
        async def go():
            async def cancelled(i: int) -> None:
                task = asyncio.ensure_future(collect(decode, GenerateRequest(f"c{i}", prompts[i % len(prompts)], params)))
                await asyncio.sleep(rng.choice([0.0, 0.0, 0.001, 0.005, 0.02, 0.05]))
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await asyncio.gather(*(cancelled(i) for i in range(48)))
            await asyncio.sleep(0.3)  # grace period of abandoned reservations
            for _ in range(3):
                await decode.engine.call(lambda e: e.step() if e.has_work() else None)
            return await run_all(decode, prompts, params)
        got = asyncio.run(go())
        assert prefill.engine.dead is None and decode.engine.dead is None
        assert got == expected

        async def idle():
            for _ in range(100):
                if decode.engine.engine.kv.usage == 0.0 and prefill.engine.engine.kv.usage == 0.0:
                    return
                await asyncio.sleep(0.05)
        asyncio.run(idle())
        assert decode.engine.engine.kv.usage == 0.0 and prefill.engine.engine.kv.usage == 0.0
        assert not decode.engine.engine.scheduler.has_work() and not prefill.engine.engine.scheduler.has_work()
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_malformed_prefill_request_fails_alone(model_dir):
    """A prefill request whose destination tables do not match the model's KV groups fails with
    KVTransferError; the prefill engine lives on, frees its blocks, and serves the next request."""
    from cluster.common.errors import KVTransferError
    from cluster.common.messages import PrefillRequest
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = mixed_prompts(300, (13,), seed=5)[0]
    expected = LLM(model_dir, block_size=4).generate([prompt], params)[0].outputs[0].token_ids
    prefill, decode = make_pair(model_dir)
    try:
        async def go():
            bad = PrefillRequest(GenerateRequest("bad", prompt, params), decode.backend.endpoint(),
                                 dest_block_tables=[], transfer_key="bad-key")
            with pytest.raises(KVTransferError, match="bad-key"):
                await prefill.prefill(bad)
            return await collect(decode, GenerateRequest("good", prompt, params))
        assert asyncio.run(go()) == expected
        assert prefill.engine.dead is None and prefill.engine.engine.kv.usage == 0.0
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("fill", ["full", "half"])
def test_prefill_death_with_decode_kv_reserved_loses_nothing(model_dir, fill):
    """The prefill replica dies while 16 remote prefills hold decode's KV (all of it, or half):
    every request is prefilled on decode instead and answered as colocated. With the pool full,
    the quarantined reservations left no block, and the scheduler failed the requests without
    telling the engine: no byte reached the clients until their deadline."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, deadline_s=30)
    prompts = mixed_prompts(300, (40,) * 16, seed=5)
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, block_size=4).generate(prompts, params)]
    per_request = 10  # 40 tokens in blocks of 4
    blocks = 16 * per_request + 1 if fill == "full" else 32 * per_request
    decode = decode_with_dying_prefill(model_dir, 0.2, num_kv_blocks=blocks)
    try:
        got = asyncio.run(asyncio.wait_for(run_all(decode, prompts, params, concurrency=16), 25))
        assert got == expected and decode.remote_prefill_failures == 16
        wait_blocks_back(decode)
    finally:
        decode.shutdown()


def test_requests_wait_their_turn_for_decode_kv_held_by_reservations(model_dir):
    """Every decode block is reserved for remote prefills (then held for the grace period after
    they fail) when more requests come: they wait, first come first served, as local requests
    wait in the scheduler's queue, and are answered as colocated; one whose deadline passes
    while it waits (behind another) gets RequestTimeoutError; one past ``max_waiting`` waiting
    requests gets OverloadedError. Before, each got OverloadedError at once: through the Ray
    app, a 503 for a request that came just after the prefill replica died."""
    from cluster.common.errors import OverloadedError, RequestTimeoutError

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, deadline_s=60)
    prompts = mixed_prompts(300, (40,) * 4, seed=6)
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, block_size=4).generate(prompts, params)]
    decode = decode_with_dying_prefill(model_dir, 3.0, num_kv_blocks=2 * 10 + 1, max_waiting=2,
                                       remote_kv_grace_s=0.2)

    async def until(condition, what, timeout=20.0):
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    async def go():
        first = [asyncio.ensure_future(collect(decode, GenerateRequest(f"a{i}", prompts[i], params)))
                 for i in range(2)]
        await until(lambda: decode.engine.engine.kv.usage == 1.0, "both reservations hold the whole pool")
        patient = asyncio.ensure_future(collect(decode, GenerateRequest("patient", prompts[3], params)))
        await until(lambda: decode.reserve_waiting == 1, "the first late request waits")
        hurried = asyncio.ensure_future(collect(decode, GenerateRequest(
            "hurried", prompts[2], params.replace(deadline_s=1.0))))
        await until(lambda: decode.reserve_waiting == 2 or hurried.done(), "the second late request waits")
        assert decode.reserve_waiting == 2
        # 2 receiving their KV + 2 waiting for blocks: routers and the planner see them all
        assert (await decode.stats("d")).num_requests_waiting == 4
        with pytest.raises(OverloadedError):
            await collect(decode, GenerateRequest("one-too-many", prompts[3], params))
        with pytest.raises(RequestTimeoutError):  # behind "patient", before any block came back
            await hurried
        assert not patient.done() and decode.reserve_waiting == 1
        return await asyncio.gather(*first), await patient

    try:
        got, patient = asyncio.run(asyncio.wait_for(go(), 60))
        assert got == expected[:2] and patient == expected[3]
        assert decode.remote_prefill_failures == 3 and decode.reserve_waiting == 0
        wait_blocks_back(decode)
        assert not decode.engine.engine.groups
    finally:
        decode.shutdown()


def test_a_slow_decode_peer_delays_only_its_own_requests(model_dir):
    """KV writes run off the prefill engine thread, a sender thread per decode worker: while every
    write to one decode worker is stuck, the prefill engine goes on prefilling and another decode
    worker's requests complete (same tokens as colocated); the stuck request's blocks stay pinned
    on the prefill side even after the request is released there, and everything comes back
    once the peer answers."""
    import threading
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = mixed_prompts(300, (9, 17, 26, 33, 41, 12), seed=21)
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, block_size=4).generate(prompts, params)]
    config = parse_cluster_args({"model": model_dir, "kv_transfer": "local", "block_size": 4,
                                 "max_num_batched_tokens": 16}, use_env=False)
    prefill = PrefillWorker(config, engine_id=f"p-{uuid.uuid4().hex[:6]}")
    fast = DecodeWorker(config, engine_id=f"fast-{uuid.uuid4().hex[:6]}", prefill_fn=prefill.prefill)
    slow = DecodeWorker(config, engine_id=f"slow-{uuid.uuid4().hex[:6]}", prefill_fn=prefill.prefill)
    gate, stuck = threading.Event(), threading.Event()
    real_send = prefill.backend._send

    def gated_send(dest, key, copies, last):
        if dest.engine_id == slow.engine_id:
            stuck.set()
            assert gate.wait(20), "the test never opened the gate"
        return real_send(dest, key, copies, last)
    prefill.backend._send = gated_send
    prefill.lifecycle.history = []
    try:
        async def go():
            slow_task = asyncio.ensure_future(collect(slow, GenerateRequest("slow", prompts[0], params)))
            while not stuck.is_set():
                await asyncio.sleep(0.01)
            start = time.monotonic()
            got = await asyncio.gather(*(collect(fast, GenerateRequest(f"f{i}", p, params))
                                         for i, p in enumerate(prompts[1:])))
            fast_s = time.monotonic() - start
            assert not slow_task.done()  # still waiting for its first write
            assert prefill.sender.queued() >= 1
            stuck_state = {state for state, n in prefill.lifecycle.counts().items() if n}
            gate.set()
            return got, fast_s, await slow_task, stuck_state
        got, fast_s, slow_tokens, stuck_state = asyncio.run(go())
        assert got == expected[1:] and slow_tokens == expected[0]
        assert fast_s < 10.0
        assert stuck_state == {P.SENDING}  # the slow request: computed, its write in flight
        assert prefill.engine.dead is None and fast.remote_prefill_failures == 0
        assert slow.remote_prefill_failures == 0
        wait_blocks_back(fast)
        wait_blocks_back(slow)
        deadline = time.monotonic() + 5
        while prefill.engine.engine.kv.usage > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert prefill.engine.engine.kv.usage == 0.0
        assert paths(prefill.lifecycle.history) == {(P.QUEUED, P.PREFILLING, P.SENDING, P.SENT, P.RELEASED)}
    finally:
        gate.set()
        prefill.shutdown()
        fast.shutdown()
        slow.shutdown()


def test_writes_in_flight_keep_their_blocks_after_the_request_is_gone(model_dir):
    """A decode caller that gives up while its KV write is stuck: the prefill worker releases the
    request at once, but the blocks the write reads stay allocated (pinned) until the write is
    done, then every block is free."""
    import threading
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = mixed_prompts(300, (37,), seed=5)[0]
    prefill, decode = make_pair(model_dir, remote_kv_grace_s=0.1)
    gate, stuck = threading.Event(), threading.Event()
    real_send = prefill.backend._send

    def gated_send(dest, key, copies, last):
        stuck.set()
        assert gate.wait(20), "the test never opened the gate"
        return real_send(dest, key, copies, last)
    prefill.backend._send = gated_send
    try:
        async def go():
            task = asyncio.ensure_future(collect(decode, GenerateRequest("gone", prompt, params)))
            while not stuck.is_set():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the prefill goes on while the first write is stuck
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for _ in range(100):  # the prefill side ends the request
                if not any(prefill.lifecycle.counts().values()):
                    break
                await asyncio.sleep(0.02)
            assert not any(prefill.lifecycle.counts().values())
            pinned = await prefill.engine.call(lambda e: (e.kv.usage, "gone" in e.kv.tables))
            gate.set()
            return pinned
        (usage, still_owned) = asyncio.run(go())
        assert usage > 0 and not still_owned  # released, yet its blocks are held by the write
        deadline = time.monotonic() + 5
        while prefill.engine.engine.kv.usage > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert prefill.engine.engine.kv.usage == 0.0
        wait_blocks_back(decode)
        assert prefill.engine.dead is None and decode.engine.dead is None
    finally:
        gate.set()
        prefill.shutdown()
        decode.shutdown()
