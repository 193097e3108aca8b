"""Pipelined decode (``async_scheduling``): step N+1 launched before step N's tokens are read.
On a GPU it runs on the CUDA graphs (tests/engine/test_cuda_graphs.py); here the same engine
logic runs eagerly on the CPU (the pipeline switched on by hand), and must give exactly the
tokens, texts and finish reasons of synchronous steps, through stops, aborts, n samples, seeds,
min_tokens, a KV pool small enough to preempt, and requests that need synchronous steps."""
from __future__ import annotations

import pytest

from cluster import LLM, SamplingParams
from tests.factories import make_checkpoint, mixed_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    make_checkpoint(path, "llama", seed=5)
    return path


def pair(model_dir, **kwargs):
    sync = LLM(model_dir, block_size=4, max_num_batched_tokens=64, **kwargs)
    piped = LLM(model_dir, block_size=4, max_num_batched_tokens=64, **kwargs)
    assert not sync.engine._pipelined  # CPU: off by default (no graphs, nothing to overlap)
    piped.engine._pipelined = True
    return sync, piped


def summary(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def test_same_outputs_as_synchronous_steps(model_dir):
    sync, piped = pair(model_dir)
    prompts = mixed_prompts(300, (3, 9, 17, 33, 50, 12), seed=3)
    base = sync.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    stop_ids = [base[0].outputs[0].token_ids[6], base[2].outputs[0].token_ids[3]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),  # finishes early, by length
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=stop_ids),  # by a stop token
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, n=3),  # seeded samples
        SamplingParams(temperature=1.0, top_k=20, min_tokens=8, max_tokens=12, seed=1, stop_token_ids=stop_ids),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]
    want = summary(sync.generate(prompts, params))
    got = summary(piped.generate(prompts, params))
    assert got == want
    assert piped.engine.num_pipelined_steps > 10 and sync.engine.num_pipelined_steps == 0
    assert piped.engine._in_flight is None or not piped.engine.groups
    # every block back in the pool once the last step is read
    piped.engine.step()
    assert piped.engine.kv.usage == 0.0


def test_stop_strings_and_max_model_len(model_dir):
    sync, piped = pair(model_dir, max_model_len=40)
    base = sync.generate("hello world", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    text = base[0].outputs[0].text
    params = [SamplingParams(temperature=0.0, max_tokens=30, stop=[text[4:7]]),
              SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)]  # runs into max_model_len
    prompts = ["hello world", list(range(5, 30))]
    assert summary(piped.generate(prompts, params)) == summary(sync.generate(prompts, params))


def test_requests_that_need_host_data_run_synchronously(model_dir):
    sync, piped = pair(model_dir)
    prompts = mixed_prompts(300, (7, 19), seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)]
    got = piped.generate(prompts, params)
    assert summary(got) == summary(sync.generate(prompts, params))
    assert piped.engine.num_pipelined_steps == 0
    assert got[1].outputs[0].logprobs is not None and len(got[1].outputs[0].logprobs) == 10


def test_abort_while_a_step_is_in_flight(model_dir):
    sync, piped = pair(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = mixed_prompts(300, (5, 11, 23), seed=2)
    want = summary(sync.generate(prompts, params))
    engine = piped.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    finished = {}
    steps = 0
    while engine.has_work():
        for out in engine.step():  # deltas: accumulate each request's
            finished[out.request_id] = finished[out.request_id].add(out) if out.request_id in finished else out
        steps += 1
        if steps == 6:
            assert engine._in_flight is not None
            engine.abort_request("r1")
    assert finished["r1"].outputs[0].finish_reason == "abort"
    assert summary([finished["r0"], finished["r2"]]) == [want[0], want[2]]
    assert engine.kv.usage == 0.0 and engine._in_flight is None


def test_preemption_and_new_arrivals_drain_the_pipeline(model_dir):
    # A pool of 24 blocks of 4 tokens cannot hold four 40-token requests: preemption by
    # recompute, with new requests arriving while others decode.
    sync, piped = pair(model_dir, num_kv_blocks=24)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = mixed_prompts(300, (16, 12, 9, 14), seed=6)
    want = summary(sync.generate(prompts, params))
    assert sync.engine.scheduler.num_preemptions > 0
    assert summary(piped.generate(prompts, params)) == want
    assert piped.engine.num_pipelined_steps > 0 and piped.engine.scheduler.num_preemptions > 0


def test_async_engine_streams_and_cancels_with_a_step_in_flight(model_dir):
    """The serving loop (AsyncEngine) over a pipelined engine: concurrent streams get the
    synchronous outputs token for token, a stream closed early aborts its request, and the
    pool is empty at the end."""
    import asyncio

    from cluster.engine.async_engine import AsyncEngine

    sync, piped = pair(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    prompts = mixed_prompts(300, (4, 15, 26, 8), seed=12)
    want = summary(sync.generate(prompts, params))
    loop_engine = AsyncEngine(piped.engine)

    async def stream(i: int, stop_after: int | None):
        group = piped.engine.make_group(f"s{i}", prompts[i], params)
        seen = []
        last = None
        async for out in loop_engine.generate(group):  # deltas: each step's new tokens
            last = out if last is None else last.add(out)
            seen.append(len(last.outputs[0].token_ids))
            if stop_after is not None and len(seen) == stop_after:
                break  # the client goes away: the request is aborted
        return last, seen

    async def main():
        return await asyncio.gather(*(stream(i, 3 if i == 1 else None) for i in range(len(prompts))))

    try:
        results = asyncio.run(main())
        for i, (last, seen) in enumerate(results):
            if i == 1:
                assert not last.finished and len(seen) == 3
                continue
            assert summary([last]) == [want[i]]
            assert seen == sorted(seen) and seen[-1] == 18  # every delta carries its new tokens
        for _ in range(200):  # the abort and the last in-flight step are processed by the loop
            if piped.engine.kv.usage == 0.0 and piped.engine._in_flight is None:
                break
            import time
            time.sleep(0.01)
        assert piped.engine.kv.usage == 0.0 and not piped.engine.groups
        assert piped.engine.num_pipelined_steps > 5
    finally:
        loop_engine.shutdown()


@pytest.mark.parametrize("max_tokens", [3, 4, 5, 7, 8])
def test_prefix_cache_registers_the_same_blocks(model_dir, max_tokens):
    """Blocks filled by the steps in flight when a request ends are registered in the prefix cache
    as synchronous steps register them (block size 4: the lengths end inside and on a block)."""
    prompts = mixed_prompts(300, (9, 17, 6), seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    counts = []
    for llm in pair(model_dir):
        llm.generate(prompts, params)
        llm.engine.step()  # read the last step in flight, if any
        counts.append(len(llm.engine.kv.pools[0].cached))
    assert counts[0] == counts[1] > 0
