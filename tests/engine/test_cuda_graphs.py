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
