"""A decode replica that prefills a prompt itself (no prefill replica, a short prompt, a saturated
prefill pool or a failed transfer) cuts the prompt into chunks sized to keep its steps within
``local_prefill_itl_share`` of ``target_itl_s``: its decoding requests keep getting tokens while
the prompt is prefilled, and the prompt's output is the colocated engine's."""
from __future__ import annotations

import asyncio
import time
import uuid

from cluster import LLM, SamplingParams
from cluster.common.messages import GenerateRequest
from cluster.config import parse_cluster_args
from cluster.decode.worker import DecodeWorker

LONG = " ".join(f"item {i} is a line of the inventory;" for i in range(60))


def test_a_decode_replica_prefilling_locally_keeps_decoding_between_chunks():
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = LLM("smollm2", enable_prefix_caching=False).generate([LONG], params)[0].outputs[0].token_ids
    config = parse_cluster_args({"model": "smollm2", "kv_transfer": "local", "prefill_replicas": 0,
                                 "target_itl_s": "0.02", "enable_prefix_caching": "false"}, use_env=False)
    decode = DecodeWorker(config, engine_id=f"d-{uuid.uuid4().hex[:6]}", prefill_fn=None)
    engine = decode.engine.engine
    assert engine.scheduler_config.prefill_step_target_s == 0.8 * 0.02  # the decode role's default

    async def run() -> tuple[list[float], list[int], float, float]:
        arrivals: list[float] = []
        long_tokens: list[int] = []
        first_long = [0.0]

        async def short() -> None:
            p = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            stream = decode.generate(GenerateRequest("short", engine.tokenizer.encode("Count to fifty."), p))
            async for out in stream:
                arrivals.extend(time.monotonic() for _ in out.new_token_ids)
                if len(first_long) == 2:  # the long request is done: leave (the worker aborts this one)
                    break
            await stream.aclose()

        async def long() -> None:
            while len(arrivals) < 3:  # the short request is decoding
                await asyncio.sleep(0.005)
            sent = time.monotonic()
            async for out in decode.generate(GenerateRequest("long", engine.tokenizer.encode(LONG), params)):
                if out.new_token_ids and not long_tokens:
                    first_long[0] = time.monotonic()
                long_tokens.extend(out.new_token_ids)
            first_long.append(sent)

        await asyncio.gather(short(), long())
        return arrivals, long_tokens, first_long[1], first_long[0]

    try:
        arrivals, long_tokens, sent, first = asyncio.run(run())
    finally:
        decode.shutdown()
    assert long_tokens == want
    during = [t for t in arrivals if sent <= t <= first]
    cap = engine.scheduler.chunk_sizer.cap
    assert cap is not None and cap < len(engine.tokenizer.encode(LONG)) // 3  # the prompt took several chunks
    assert len(during) >= 3  # ... and the short request decoded between them
