"""What a stream ships per step does not grow with the output: the engine emits deltas and the
decode worker passes them on (new token ids and new text only), so a 4,000-token generation's last
outputs are as small as its first, on the engine's side and on the wire (pickled, as Ray ships
them), and the accumulated output equals the offline one."""
from __future__ import annotations

import asyncio
import pickle
import statistics
import uuid

import pytest

from cluster import LLM, SamplingParams
from cluster.common.messages import GenerateRequest
from cluster.config import parse_cluster_args
from cluster.decode.worker import DecodeWorker
from tests.factories import make_checkpoint, mixed_prompts

LENGTH = 4000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama-long"))
    make_checkpoint(path, "llama", max_position_embeddings=LENGTH + 64)
    return path


def test_bytes_per_step_stay_flat_over_4000_tokens(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=LENGTH, ignore_eos=True)
    prompt = mixed_prompts(300, (12,), seed=21)[0]
    config = parse_cluster_args({"model": model_dir, "kv_transfer": "local", "block_size": 16,
                                 "max_model_len": LENGTH + 32}, use_env=False)
    decode = DecodeWorker(config, engine_id=f"d-{uuid.uuid4().hex[:6]}", prefill_fn=None)
    try:
        async def go():
            return [out async for out in decode.generate(GenerateRequest("long", prompt, params))]
        outs = asyncio.run(go())
    finally:
        decode.shutdown()
    assert sum(len(o.new_token_ids) for o in outs) == LENGTH and outs[-1].finish_reason == "length"
    sizes = [len(pickle.dumps(o)) for o in outs]
    early, late = statistics.median(sizes[10:210]), statistics.median(sizes[-201:-1])
    assert late <= early * 1.25 + 16, (early, late)  # flat: a cumulative text would be ~100x here
    offline = LLM(model_dir, block_size=16, max_model_len=LENGTH + 32).generate([prompt], params)[0].outputs[0]
    assert [t for o in outs for t in o.new_token_ids] == offline.token_ids
    assert "".join(o.new_text for o in outs) == offline.text


def test_engine_deltas_stay_flat(model_dir):
    """The engine's own outputs: each step's RequestOutput holds that step's token, not all of them."""
    llm = LLM(model_dir, block_size=16, max_model_len=1200)
    engine = llm.engine
    engine.add_request("d", mixed_prompts(300, (7,), seed=22)[0],
                       SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))
    sizes = []
    while engine.has_work():
        for out in engine.step():
            assert len(out.outputs) <= 1 and all(len(c.token_ids) <= 1 for c in out.outputs)
            sizes.append(len(pickle.dumps(out.outputs)))
    assert len(sizes) >= 1000
    assert statistics.median(sizes[-100:]) <= statistics.median(sizes[:100]) * 1.25 + 16
