"""On a GPU: decode steps replayed from captured CUDA graphs give exactly the tokens of eager
steps, for batches that fill a graph exactly, need padding, or exceed the largest graph."""
from __future__ import annotations

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.factories import make_checkpoint, mixed_prompts

pytestmark = pytest.mark.gpu
ON_GPU = torch.cuda.is_available()


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_graph_replay_equals_eager(tmp_path):
    path = str(tmp_path / "llama")
    make_checkpoint(path, "llama", max_position_embeddings=1024)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = mixed_prompts(300, (3, 17, 40, 64, 9, 33, 5, 21, 50, 12), seed=4)
    common = dict(block_size=16, dtype="float32", attention_backend="triton", max_num_seqs=8)
    eager = LLM(path, enforce_eager=True, **common)
    graphed = LLM(path, **common)
    assert graphed.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    assert graphed.engine.runner.graphs.sizes == [1, 2, 4, 8]
    for batch in (prompts[:1], prompts[:3], prompts[:8], prompts):  # exact, padded, full, over the largest
        want = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
        got = [o.outputs[0].token_ids for o in graphed.generate(batch, params)]
        assert got == want
    assert graphed.engine.num_pipelined_steps > 0  # decode steps ran pipelined on the graphs


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_pipelined_graph_steps_equal_synchronous_ones(tmp_path):
    """async_scheduling on the graphs: the same tokens as synchronous graph steps, for greedy,
    seeded top-p and stop-token requests finishing at different steps."""
    path = str(tmp_path / "llama")
    make_checkpoint(path, "llama", max_position_embeddings=1024)
    prompts = mixed_prompts(300, (3, 17, 40, 64, 9, 33), seed=5)
    common = dict(block_size=16, dtype="float32", attention_backend="triton", max_num_seqs=8)
    sync = LLM(path, async_scheduling=False, **common)
    piped = LLM(path, **common)
    base = sync.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[base[2].outputs[0].token_ids[5]]),
              SamplingParams(temperature=0.9, top_p=0.8, max_tokens=20, seed=3, n=2),
              SamplingParams(temperature=1.0, top_k=10, max_tokens=16, seed=4),
              SamplingParams(temperature=0.0, max_tokens=1)]
    want = [[c.token_ids for c in o.outputs] for o in sync.generate(prompts, params)]
    got = [[c.token_ids for c in o.outputs] for o in piped.generate(prompts, params)]
    assert got == want
    assert piped.engine.num_pipelined_steps > 10 and sync.engine.num_pipelined_steps == 0
