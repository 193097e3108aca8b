"""Decode steps replayed from CUDA graphs give exactly the tokens of eager steps, for batches that
fill a graph exactly, need padding, or exceed the largest graph: captured on a GPU; on the CPU
emulated (the graphs' static-buffer path, each replay checked for host reads, see
``DecodeGraphs``), for the Llama family and DeepSeek-V4. A graph that replays other values than
the eager forward is caught at start-up."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.engine.cuda_graphs import GraphSafetyCheck, GraphUnsafeError
from tests.deepseek_factories import make_v4_checkpoint
from tests.factories import make_checkpoint, mixed_prompts

ON_GPU = torch.cuda.is_available()


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_deepseek_v4_graph_replay_equals_eager(tmp_path):
    """DeepSeek-V4 (sliding, CSA and HCA layers, hash and learned routing) decodes in captured
    graphs to the eager tokens."""
    path = str(tmp_path / "v4")
    make_v4_checkpoint(path, "csa_hca")
    common = dict(block_size=16, dtype="bfloat16", max_num_seqs=8, max_model_len=512)
    eager = LLM(path, enforce_eager=True, **common)
    graphed = LLM(path, **common)
    assert graphed.engine.runner.graphs is not None and graphed.engine.runner.graphs.sizes == [1, 2, 4, 8]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = mixed_prompts(500, (3, 17, 40, 64, 9, 33, 5, 21, 50, 12), seed=4)
    for batch in (prompts[:1], prompts[:3], prompts):
        want = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
        assert [o.outputs[0].token_ids for o in graphed.generate(batch, params)] == want
    assert graphed.engine.num_pipelined_steps > 0


def test_graph_safety_check_refuses_host_reads():
    x = torch.arange(6)
    refused = [lambda: x[0].item(), lambda: x.tolist(), lambda: x.nonzero(), lambda: x[x > 2],
               lambda: torch.tensor([1, 2]), lambda: bool((x > 2).any()), lambda: torch.unique(x)]
    for op in refused:
        with GraphSafetyCheck(), pytest.raises(GraphUnsafeError):
            op()
    with GraphSafetyCheck():  # batched, value-independent ops pass; constants are kernel arguments
        y = torch.where(x > 2, x, 0).gather(0, x.flip(0))
        y[..., 0] = 7
        torch.topk(y.float(), 2)
    assert x.tolist() == [0, 1, 2, 3, 4, 5]  # restored on exit


def graphed_pair(path: str, **settings):
    """An eager LLM and one decoding on emulated graphs, pipelined as on a GPU."""
    eager = LLM(path, enforce_eager=True, **settings)
    graphed = LLM(path, enforce_eager=True, **settings)
    engine = graphed.engine
    assert engine.runner.capture_cuda_graphs(engine.scheduler_config.max_num_seqs,
                                             engine.scheduler_config.max_model_len, emulate=True)
    engine._pipelined = True
    return eager, graphed


def test_emulated_graph_replay_equals_eager(tmp_path):
    """Llama family on the CPU: padding rows, placeholder host lists and input tokens taken from
    the step in flight give the eager tokens, greedy and seeded."""
    path = str(tmp_path / "llama")
    make_checkpoint(path, "llama", max_position_embeddings=256)
    eager, graphed = graphed_pair(path, block_size=16, dtype="float32", attention_backend="triton",
                                  max_num_seqs=4, max_model_len=256)
    assert graphed.engine.runner.graphs.sizes == [1, 2, 4]
    prompts = mixed_prompts(300, (3, 17, 40, 9, 21), seed=4)
    for batch, params in ((prompts[:3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
                          (prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, seed=3))):
        want = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
        assert [o.outputs[0].token_ids for o in graphed.generate(batch, params)] == want
    assert graphed.engine.num_pipelined_steps > 0


def test_emulated_deepseek_v4_graphs_equal_eager_and_padding_writes_nothing(tmp_path):
    """DeepSeek-V4 on the CPU (Triton kernels interpreted): a decode batch padded into a larger
    graph gives the eager tokens, and the padding rows (slot -1, null block tables) leave every
    block but the null block as it was: the pool's last block, unused here, keeps its bytes."""
    path = str(tmp_path / "v4")
    make_v4_checkpoint(path, "csa_hca")
    eager, graphed = graphed_pair(path, block_size=4, attention_backend="triton", moe_backend="triton",
                                  max_num_seqs=4)
    assert graphed.engine.model.supports_cuda_graphs
    caches = graphed.engine.runner.kv_caches
    for cache in caches:
        cache[-1].normal_()
    last = [cache[-1].clone() for cache in caches]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = mixed_prompts(500, (3, 17, 30), seed=4)  # three sequences in the graph of four
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params)] == want
    assert graphed.engine.num_pipelined_steps > 0
    assert all(torch.equal(cache[-1], before) for cache, before in zip(caches, last))


def test_verify_refuses_a_graph_that_froze_its_inputs(tmp_path):
    """``DecodeGraphs.verify`` replays the largest graph on fresh inputs against the eager forward:
    a faithful graph passes; one whose replay returns what it computed at capture is refused."""
    path = str(tmp_path / "llama")
    make_checkpoint(path, "llama", max_position_embeddings=128)
    llm = LLM(path, enforce_eager=True, block_size=16, dtype="float32", attention_backend="triton",
              max_num_seqs=2, max_model_len=128)
    runner = llm.engine.runner
    assert runner.capture_cuda_graphs(2, 128, emulate=True)
    graphs = runner.graphs
    graphs.verify()

    class Frozen:
        def __init__(self) -> None:
            graphs.input_ids.zero_()
            self.output = graphs.forward(2).clone()

        def replay(self) -> None:
            graphs.outputs[2] = self.output
    graphs.graphs[2] = Frozen()
    with pytest.raises(GraphUnsafeError, match="batch 2"):
        graphs.verify()
    assert np.all(graphs.slot_mappings[0].numpy() == -1)  # the placeholders are back
