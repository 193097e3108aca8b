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
from cluster.engine.cuda_graphs import DecodeGraphs, GraphSafetyCheck, GraphUnsafeError
from cluster.engine.engine import announce_graph_status
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
    status = engine.runner.capture_cuda_graphs(engine.scheduler_config.max_num_seqs,
                                               engine.scheduler_config.max_model_len, emulate=True)
    assert status.captured, status.describe()
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


def emulated_llama_graphs(tmp_path, max_num_seqs: int, **settings) -> DecodeGraphs:
    """Emulated decode graphs of a small random Llama (float32, Triton kernels interpreted)."""
    path = str(tmp_path / "llama")
    make_checkpoint(path, "llama", max_position_embeddings=128)
    llm = LLM(path, enforce_eager=True, block_size=16, dtype="float32", attention_backend="triton",
              max_num_seqs=max_num_seqs, max_model_len=128, **settings)
    status = llm.engine.runner.capture_cuda_graphs(max_num_seqs, 128, emulate=True)
    assert status.captured, status.describe()
    return llm.engine.runner.graphs


def test_verify_refuses_a_graph_that_froze_its_inputs(tmp_path):
    """``DecodeGraphs.verify`` replays the largest graph on fresh inputs against the eager forward:
    a faithful graph passes; one whose replay returns what it computed at capture is refused."""
    graphs = emulated_llama_graphs(tmp_path, 2)
    assert graphs.verify() == 2

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


class _RowsReversed:
    """An emulated graph whose replay runs its rows in reverse order, as a GPU may order the rows
    of one launch otherwise than the eager run did: rows that shared a KV slot would each read
    the other row's write."""

    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        g, n = self.graphs, self.size
        buffers = [g.input_ids, g.positions, g.seq_lens, *g.block_tables, *[s for s in g.slot_mappings if s is not None]]
        saved = [b[:n].clone() for b in buffers]
        for b in buffers:
            b[:n] = b[:n].flip(0).clone()
        try:
            g.outputs[n] = g.forward(n).flip(0)
        finally:
            for b, before in zip(buffers, saved):
                b[:n] = before


def test_verify_gives_every_row_its_own_kv_slots(tmp_path):
    """The self-check after capture must not race: on a GPU the rows of a batch run at once, and a
    check whose rows all wrote slot 0 of one block compared whichever row won (it differed
    between the eager run and the replay, and turned decode graphs off on every GPU). A faithful
    graph that runs its rows in another order passes, and the blocks the check used keep their
    bytes."""
    graphs = emulated_llama_graphs(tmp_path, 4)
    for cache in graphs.kv_caches:
        cache.normal_()
    before = [cache.clone() for cache in graphs.kv_caches]
    graphs.graphs[4] = _RowsReversed(graphs, 4)
    assert graphs.verify() == 4
    assert all(torch.equal(cache, b) for cache, b in zip(graphs.kv_caches, before))
    assert np.all(graphs.slot_mappings[0].numpy() == -1) and not graphs.block_tables[0].any()


def test_verify_checks_the_largest_size_the_pool_can_hold(tmp_path):
    """With fewer free blocks than the largest graph's rows, the check runs the largest graph that
    gives each row a block of its own."""
    graphs = emulated_llama_graphs(tmp_path, 8, num_kv_blocks=6)
    assert graphs.sizes == [1, 2, 4, 8] and graphs.verified_size == 4


def test_graph_status_says_why_graphs_are_off(tmp_path, monkeypatch, caplog):
    """Graphs off for any reason is visible: the ``cuda_graphs`` row of ``backends()`` (served at
    /v1/backends), the ``cuda_graphs_captured`` metric, and on a GPU a start-up warning."""
    path = str(tmp_path / "llama")
    make_checkpoint(path, "llama", max_position_embeddings=128)
    common = dict(block_size=16, dtype="float32", max_num_seqs=2, max_model_len=128)

    def graph_row(llm):
        rows = [b for b in llm.engine.backends() if b["component"] == "cuda_graphs"]
        assert len(rows) == 1
        return rows[0]
    cpu = LLM(path, attention_backend="triton", **common)
    assert graph_row(cpu)["impl"] == "off" and "the device is cpu" in graph_row(cpu)["reason"]
    assert cpu.engine.metrics()["cuda_graphs_captured"] == 0.0
    eager = LLM(path, enforce_eager=True, attention_backend="triton", **common)
    assert graph_row(eager)["reason"] == "off: enforce_eager is set"
    reference = LLM(path, enforce_eager=True, attention_backend="torch", **common)
    status = reference.engine.runner.capture_cuda_graphs(2, 128, emulate=True)
    assert not status.captured and "attention runs paged_attention_ref" in status.reason

    def broken(self):
        raise GraphUnsafeError("decode graph of batch 2 replayed other hidden states")
    monkeypatch.setattr(DecodeGraphs, "verify", broken)
    status = eager.engine.runner.capture_cuda_graphs(2, 128, emulate=True)
    assert not status.captured and eager.engine.runner.graphs is None
    assert graph_row(eager)["reason"].startswith("off: self-check failed: GraphUnsafeError")
    with caplog.at_level("INFO", logger="cluster.engine.engine"):
        announce_graph_status(status, torch.device("cuda"), decodes=True)
        announce_graph_status(status, torch.device("cuda"), decodes=False)
    announced = [r for r in caplog.records if r.name == "cluster.engine.engine"]
    assert [r.levelname for r in announced] == ["WARNING", "INFO"]
    assert "OFF (self-check failed" in announced[0].getMessage()
    monkeypatch.undo()
    captured = eager.engine.runner.capture_cuda_graphs(2, 128, emulate=True)
    assert graph_row(eager)["impl"] == "captured" and eager.engine.metrics()["cuda_graphs_captured"] == 1.0
    assert graph_row(eager)["reason"] == "captured: batch sizes 1, 2 (batch 2 verified against the eager forward)"
    assert captured.describe() == graph_row(eager)["reason"]
