"""Speculative decoding on DeepSeek-V4, whose compressors update a state in place: a verified
position pools from its predecessor's state and keeps its own in a row of its own until the
acceptance, and the accepted position's becomes the checkpoint (``ModelRunner.commit_verified``).

Checked on small random V4 configurations (CSA ratio 4 and HCA 8 over a window of 8; HCA 16 and CSA
2 over 5), blocks of 4 tokens, so that rejected drafts fall across compression windows, sliding
windows and blocks:
- greedy output equals decoding without speculation whatever the drafts (always right, always
  wrong, right for the first 1 or 2 of 3), also with chunked prefill (verify rows in mixed
  batches: the chunk path), preemption and prefix hits;
- after every step, every request's state (its window entries, compressed entries and indexer
  keys, and the compressors' checkpoint) is the state of the same request decoded without
  speculation to the same length: what it would be had the rejected drafts never been seen;
- the MTP layer drafting (``speculative_method=mtp``): greedy, seeded and n > 1 output unchanged,
  every block of every group freed after 120 requests with aborts, and a prefill worker hands
  decode the layer's state, so decode recomputes nothing of the prompt."""
from __future__ import annotations

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.deepseek_factories import make_v4_checkpoint
from tests.engine.test_spec_decode import Oracle
from tests.factories import generate_disaggregated, local_pd_workers, mixed_prompts, output_summary, run_with_aborts
from tests.models.test_deepseek_v4_mtp import add_mtp

pytestmark = pytest.mark.usefixtures("one_thread")
K = 3
PROMPTS = mixed_prompts(512, (3, 9, 17, 26, 33), seed=7)


@pytest.fixture(scope="module", params=["csa_hca", "hca_csa"])
def v4(request, tmp_path_factory, one_thread):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_v4_checkpoint(path, request.param)
    add_mtp(path, hf.config.to_dict())
    return path


def greedy(n: int = 30) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def oracle_llm(path: str, prompts, params, right, **kwargs) -> tuple[LLM, LLM]:
    """(no speculation, the oracle proposer over the reference outputs)."""
    base = LLM(path, block_size=4, **kwargs)
    reference = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, base.generate(prompts, params))}
    llm = LLM(path, block_size=4, speculative_method="ngram", num_speculative_tokens=K, **kwargs)
    llm.engine.proposer = Oracle(reference, right, 512)
    return base, llm


@pytest.mark.parametrize("right", [None, 0, 1, 2])
@pytest.mark.parametrize("case", ["plain", "chunked", "preempting"])
def test_greedy_output_is_unchanged_whatever_the_drafts(v4, right, case):
    settings = {"plain": {}, "chunked": {"max_num_batched_tokens": 8},
                "preempting": {"num_kv_blocks": 24, "max_num_batched_tokens": 32}}[case]
    prompts = PROMPTS + [PROMPTS[3][:16] + [5, 6, 7]]  # a prefix hit on a prompt's blocks
    base, llm = oracle_llm(v4, prompts, greedy(), right, **settings)
    want = output_summary(base.generate(prompts, greedy()))
    assert output_summary(llm.generate(prompts, greedy())) == want
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 10
    if right is None:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.accepted_per_pos[right:] == [0] * (K - right) and stats.num_accepted_tokens <= right * stats.num_drafts
    if case == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.usage == 0.0


def request_state(engine, request_id: str) -> list[torch.Tensor]:
    """Everything a request carries in the KV groups up to its computed tokens: per group, the
    window entries, the compressed entries, or the compressors' checkpoint after its last token."""
    r = engine.scheduler.requests[request_id]
    c = r.num_computed_tokens
    tables = engine.kv.block_tables(request_id)
    out = []
    for spec, cache, table in zip(engine.kv_specs, engine.runner.kv_caches, tables):
        if spec.kind == "state":
            out.append(cache[table[(c - 1) // spec.block_size]].clone())
            continue
        if spec.kind == "compressed":
            first, end = 0, c // spec.compress_ratio
        else:
            first, end = max(0, c - (spec.sliding_window or c)), c
        idx = torch.arange(first, end)
        blocks = torch.tensor(table)[idx // spec.block_size]
        out.append(cache[blocks, :, idx % spec.block_size].clone())
    return out


@pytest.mark.parametrize("right", [0, 1, 2])
def test_state_after_each_step_is_the_state_without_the_rejected_drafts(v4, right):
    prompts = PROMPTS[2:4]
    base, llm = oracle_llm(v4, prompts, greedy(40), right, enable_prefix_caching=False)
    snapshots: dict[tuple[str, int], list[torch.Tensor]] = {}
    for engine, compare in ((base.engine, False), (llm.engine, True)):
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, greedy(40))
        checked = 0
        while engine.has_work():
            engine.step()
            for r in list(engine.scheduler.running):
                if r.num_output_tokens == 0:
                    continue
                key = (r.request_id, r.num_computed_tokens)
                state = request_state(engine, r.request_id)
                if not compare:
                    snapshots[key] = state
                elif key in snapshots:
                    for got, want in zip(state, snapshots[key]):
                        # float rounding only (a verify batch's matmuls have other shapes); a
                        # rejected token's trace would be of the values' own size
                        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
                    checked += 1
        assert engine.kv.usage == 0.0
    assert checked > 15  # steps after rejected drafts compared, across windows and blocks
    assert llm.engine.spec_stats.num_accepted_tokens > 0 or right == 0


def test_mtp_output_equals_no_speculation(v4):
    prompts = PROMPTS
    params = [greedy(30), SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, n=2),
              greedy(7), SamplingParams(temperature=0.0, max_tokens=25, n=2, ignore_eos=True), greedy(33)]
    want = output_summary(LLM(v4, block_size=4, max_num_batched_tokens=16).generate(prompts, params))
    llm = LLM(v4, block_size=4, max_num_batched_tokens=16, speculative_method="mtp", num_speculative_tokens=2)
    assert output_summary(llm.generate(prompts, params)) == want
    engine = llm.engine
    assert engine.spec_stats.num_drafts > 20 and engine.runner.drafter.num_passes > 20
    rows = {r["component"]: r for r in engine.backends()}
    assert rows["speculative_decoding"]["impl"] == "mtp" and "mtp" in rows
    assert engine.kv.usage == 0.0 and not engine.runner.drafter.states


def test_mtp_with_aborts_frees_every_block(v4):
    llm = LLM(v4, block_size=4, max_num_batched_tokens=24, speculative_method="mtp", num_speculative_tokens=2)
    run_with_aborts(llm.engine, PROMPTS, requests=120)
    assert llm.engine.kv.usage == 0.0 and not llm.engine.runner.drafter.states


def test_prefill_hands_the_mtp_state_to_decode_which_recomputes_nothing(v4):
    params = greedy(20)
    with local_pd_workers({"model": v4, "block_size": 4, "max_num_batched_tokens": 16, "speculative_method": "mtp",
                           "num_speculative_tokens": 2, "enable_prefix_caching": False}) as (prefill, decode):
        got = generate_disaggregated(decode, PROMPTS, params)
        want = [o.outputs[0].token_ids for o in LLM(v4, block_size=4).generate(PROMPTS, params)]
        assert got == want
        engine = decode.engine.engine
        drafter = engine.runner.drafter
        assert drafter.num_seeded == len(PROMPTS) and drafter.num_cold_starts == 0
        # decode ran the layer over generated positions only (and each step's chained drafts)
        outputs = sum(len(t) for t in got)
        assert drafter.num_positions <= outputs + (2 - 1) * engine.spec_stats.num_drafts
        assert prefill.engine.engine.runner.drafter.num_positions >= sum(len(p) for p in PROMPTS) - len(PROMPTS)
