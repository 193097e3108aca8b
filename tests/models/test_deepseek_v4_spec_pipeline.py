"""Pipelined verify steps on DeepSeek-V4 (cluster/engine/spec_pipeline.py) on the CPU: six KV groups,
the MTP layer drafting from its (emulated) draft graphs, the verify steps replayed from the
(emulated) verify-step graphs with the Triton kernels interpreted, and the compressors' states of
the accepted positions committed on the device (``DecodeGraphs.commit_states``), each step
launched from the previous one's results before that one's tokens are read.

A random MTP layer accepts next to nothing, so the layer's drafts are replaced by an oracle that
knows the reference continuation and is wrong at every fifth position: drafts are then accepted
and rejected across compression windows (CSA 4, HCA 8), sliding windows (8) and blocks (4). Greedy,
seeded and ``n > 1`` output equals decoding without speculation token for token; prompts that
extend earlier outputs hit blocks whose state checkpoints the device committed and still decode
the same; aborts mid-epoch free every block of every group. They are on by default since the GPU
gate ran them; ``pipelined_verify_kv_groups=False`` turns them off, and the engine says so."""
from __future__ import annotations

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.deepseek_factories import make_v4_checkpoint
from tests.factories import mixed_prompts, output_summary, run_with_aborts
from tests.models.test_deepseek_v4_mtp import add_mtp

pytestmark = pytest.mark.usefixtures("one_thread")
K = 2
PROMPTS = mixed_prompts(512, (3, 9, 17, 26), seed=7)
#: The interpreted Triton kernels (the references loop on the host, which a graph refuses).
TRITON = dict(attention_backend="triton", moe_backend="triton", draft_moe_backend="triton")


@pytest.fixture(scope="module")
def v4(tmp_path_factory, one_thread):
    path = str(tmp_path_factory.mktemp("csa_hca"))
    hf = make_v4_checkpoint(path, "csa_hca")
    add_mtp(path, hf.config.to_dict())
    return path


class OracleMTP:
    """The MTP layer (run as ever: its KV written, its streams chained), its drafts replaced by the
    reference's next token after the row's (position, token), wrong where that next position is a
    multiple of 5. The guess rides in the streams' last two columns (base 32, exact in any float)."""

    def __init__(self, real, outputs: list[list[int]], vocab: int, length: int, device: torch.device) -> None:
        self.real = real
        table = torch.zeros((length, vocab), dtype=torch.int64)
        for seq in outputs:
            for q in range(len(seq) - 1):
                nxt = seq[q + 1] if (q + 1) % 5 else (seq[q + 1] + 1) % vocab
                table[q, seq[q]] = nxt
        self.table = table.to(device)

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx) -> torch.Tensor:
        g = self.real.draft(input_ids, hidden, ctx)
        guess = self.table[ctx.positions.clamp(max=self.table.shape[0] - 1), input_ids]
        return torch.cat((g[:, :-2], torch.stack((guess // 32, guess % 32), dim=1).to(g.dtype)), dim=1)

    def draft_tokens(self, g: torch.Tensor, scale=None, gumbel=None) -> torch.Tensor:
        return g[:, -2].round().long() * 32 + g[:, -1].round().long()


def pipelined_llm(path: str, outputs: list[list[int]], emulate: bool = True, **kwargs) -> LLM:
    """The MTP engine with decode, draft and verify-step graphs (emulated, or captured on a GPU)
    and the oracle drafting."""
    settings = {"block_size": 4, "max_num_seqs": 8, **TRITON, **kwargs}
    llm = LLM(path, speculative_method="mtp", num_speculative_tokens=K, enforce_eager=True,
              pipelined_verify_kv_groups=True, **settings)
    engine = llm.engine
    assert "CUDA graphs" in engine.spec_pipeline_status
    runner = engine.runner
    runner.drafter.head = OracleMTP(runner.drafter.head, outputs, int(engine.model.vocab_size), 256, engine.device)
    status = runner.capture_cuda_graphs(settings["max_num_seqs"] * (1 + K), engine.scheduler_config.max_model_len,
                                        emulate=emulate, verify_depth=1 + K)
    assert status.captured, status.describe()
    engine._capture_draft_graphs(emulate=emulate)
    assert runner.verify_graph_status.captured, runner.verify_graph_status.describe()
    engine._init_spec_pipelining()
    assert engine._spec_pipelined and engine.spec_pipeline_status == "", engine.spec_pipeline_status
    return llm


def test_pipelined_mtp_output_equals_no_speculation(v4):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.8, seed=5, max_tokens=20),  # seeded: the sampled graph
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # max_tokens inside a run
              SamplingParams(temperature=0.0, max_tokens=20, n=2, ignore_eos=True)]
    base = LLM(v4, block_size=4)
    first = base.generate(PROMPTS, params)
    want = output_summary(first)
    outputs = [list(p) + list(c.token_ids) for p, o in zip(PROMPTS, first) for c in o.outputs]
    # second round: prompts extending the first outputs (prefix hits on blocks whose states the
    # device committed)
    later = [list(PROMPTS[i]) + list(first[i].outputs[0].token_ids[:13]) for i in (0, 3)]
    second = base.generate(later, greedy)
    want_later = output_summary(second)
    outputs += [list(p) + list(o.outputs[0].token_ids) for p, o in zip(later, second)]
    llm = pipelined_llm(v4, outputs)
    engine = llm.engine
    assert output_summary(llm.generate(PROMPTS, params)) == want
    steps, stats = engine.num_pipelined_verify_steps, engine.spec_stats
    # drafts accepted and rejected (the oracle errs at every fifth position), most steps pipelined
    assert steps >= 6 and stats.num_accepted_tokens >= 20 and stats.accepted_per_pos[0] < stats.num_drafts
    assert engine.runner.num_verify_graph_steps >= steps - 1 and engine.runner.num_sampled_verify_graph_steps > 0
    again = llm.generate(later, greedy)
    assert output_summary(again) == want_later
    assert again[0].num_cached_tokens >= 8  # past its 3-token prompt: blocks the verify steps completed
    assert engine.num_pipelined_verify_steps > steps
    row = next(r for r in engine.backends() if r["component"] == "speculative_decoding")
    assert "verify steps pipelined" in row["reason"]
    assert engine.kv.usage == 0.0 and not engine.runner.drafter.states


def test_on_by_default_and_when_turned_off_said(v4):
    from cluster.config import ModelConfig
    assert ModelConfig(model=v4).pipelined_verify_kv_groups  # on by default since the GPU gate ran them
    llm = LLM(v4, block_size=4, speculative_method="mtp", num_speculative_tokens=K, max_num_seqs=4,
              pipelined_verify_kv_groups=False)
    engine = llm.engine  # (the rule comes before the graphs' on a CPU)
    assert not engine._spec_pipelined
    assert "pipelined_verify_kv_groups is off" in engine.spec_pipeline_status
    assert "6 groups (swa, csa_kv, csa_index, csa_state, hca_kv, hca_state)" in engine.spec_pipeline_status
    row = next(r for r in engine.backends() if r["component"] == "speculative_decoding")
    assert "pipelined_verify_kv_groups is off" in row["reason"]


def test_pipelined_mtp_with_aborts_frees_every_block(v4):
    llm = pipelined_llm(v4, [list(p) for p in PROMPTS], max_num_seqs=2)
    run_with_aborts(llm.engine, PROMPTS, requests=8)
    engine = llm.engine
    assert engine.num_pipelined_verify_steps > 0
    engine.step()  # the step in flight, if any, is read
    assert engine.kv.usage == 0.0 and not engine.runner.drafter.states and engine._verify_in_flight is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pipelined_mtp_on_the_gpu_equals_synchronous_verify_steps(v4):
    """On a GPU (bfloat16, real CUDA graphs, the oracle drafting): V4's verify steps launched from
    the device (six KV groups, the compressors' states committed there, the MTP layer's next drafts
    from its draft graphs) give the tokens of the same verify steps run synchronously (the same
    rows through the same decode graphs), greedy and ``n > 1``; every block freed."""
    common = dict(block_size=16, max_model_len=256, dtype="bfloat16")
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, n=2, ignore_eos=True)]
    params = [params[i % len(params)] for i in range(len(PROMPTS))]
    first = LLM(v4, **common, **TRITON).generate(PROMPTS, greedy)
    outputs = [list(p) + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, first)]
    sync = pipelined_llm(v4, outputs, emulate=False, **common)
    sync.engine._spec_pipelined = False
    want = output_summary(sync.generate(PROMPTS, params))
    llm = pipelined_llm(v4, outputs, emulate=False, **common)
    engine = llm.engine
    assert output_summary(llm.generate(PROMPTS, params)) == want
    assert engine.num_pipelined_verify_steps >= 6 and engine.spec_stats.num_accepted_tokens >= 20
    assert engine.spec_stats.accepted_per_pos == sync.engine.spec_stats.accepted_per_pos
    assert engine.runner.num_verify_graph_steps == engine.num_pipelined_verify_steps
    engine.step()
    assert engine._verify_in_flight is None and engine.kv.usage == 0.0
