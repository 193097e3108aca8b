"""A request's n samples share one prefill: the step that draws sample 0's first token draws the
others' from the same logits (each with its own seed), and they fork sample 0's KV (full blocks
shared, the last partial block copied). Every sample's tokens equal those of a request that
computes that sample alone (same seed, same sample index), on Llama and on DeepSeek-V4 (window,
compressed and state groups), with and without prefix caching, when the pool is too small to
fork, and when sample 0 ends at its first token."""
from __future__ import annotations

import itertools

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.common.kv_spec import KVGroupSpec
from cluster.engine.kv_cache_manager import KVCacheManager
from tests.deepseek_factories import make_v4_checkpoint
from tests.factories import make_checkpoint, mixed_prompts

_ids = itertools.count()
SEEDED = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
GREEDY = SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    make_checkpoint(path, "llama")
    return path


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v4"))
    make_v4_checkpoint(path, "csa_hca")
    return path


def run(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[list[int]], int]:
    """The request's samples' tokens, and the prompt tokens the model computed for them (a
    pipelined engine also computes one step for nothing after a stop: not counted here)."""
    engine = llm.engine
    group = engine.make_group(f"fork-{next(_ids)}", prompt, params)
    engine.add_group(group)
    computed = 0
    while not group.finished:
        engine.step()
        computed += sum(max(0, min(start + n, len(prompt)) - start) for _, start, n in engine.last_step)
    while engine.has_work():  # drain the outputs
        engine.step()
    return [list(s.output_token_ids) for s in group.samples], computed


def alone(llm: LLM, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """Each sample computed by a request of its own (its own prefill), as sample ``i``."""
    engine = llm.engine
    tokens = []
    for i in range(params.n):
        engine.kv.reset_prefix_cache()
        group = engine.make_group(f"alone-{next(_ids)}", prompt, params.replace(n=1), sample_index=i)
        engine.add_group(group)
        while engine.has_work():
            engine.step()
        tokens.append(list(group.samples[0].output_token_ids))
    return tokens


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-caching"])
def test_samples_fork_one_prefill_and_equal_samples_computed_alone(llama_dir, caching):
    """150 tokens (9 full blocks of 16 and 6 tokens in a partial one): the model computes the
    prompt once and then one token per sample per step; each sample equals itself alone."""
    prompt = mixed_prompts(256, (150,), seed=3)[0]
    llm = LLM(llama_dir, block_size=16, max_model_len=512, enable_prefix_caching=caching)
    engine = llm.engine
    for params in (SEEDED, GREEDY):
        engine.kv.reset_prefix_cache()
        forked, hits = engine.num_forked_samples, engine.scheduler.prefix_hit_tokens
        got, computed = run(llm, prompt, params)
        assert got == alone(llm, prompt, params)
        assert computed == 150  # the prompt once
        assert engine.num_forked_samples - forked == params.n - 1
        assert engine.scheduler.prefix_hit_tokens == hits  # forked, not found in the cache
    assert len({tuple(t) for t in run(llm, prompt, SEEDED)[0]}) > 1  # the seeds differ per sample
    assert engine.kv.usage == 0.0 and not engine.groups
    assert engine.counters()["forked_samples_total"] == engine.num_forked_samples


def test_prompt_ending_on_a_block_boundary_shares_every_block(llama_dir):
    prompt = mixed_prompts(256, (64,), seed=5)[0]  # 4 full blocks, nothing partial
    llm = LLM(llama_dir, block_size=16, max_model_len=512)
    engine = llm.engine
    group = engine.make_group("edge", prompt, GREEDY)
    engine.add_group(group)
    while group.samples[0].num_output_tokens == 0:
        engine.step()
    tables = [engine.kv.block_tables(s.request_id)[0] for s in group.samples]
    assert all(len(t) == 4 for t in tables) and tables[1] == tables[0] == tables[2]
    while engine.has_work():
        engine.step()
    assert [list(s.output_token_ids) for s in group.samples] == alone(llm, prompt, GREEDY)
    assert engine.kv.usage == 0.0


def test_forked_partial_block_is_a_copy(llama_dir):
    """The full blocks are the same block ids; the partial one is a new block holding the same KV."""
    prompt = mixed_prompts(256, (40,), seed=6)[0]  # 2 full blocks of 16, 8 tokens in the third
    llm = LLM(llama_dir, block_size=16, max_model_len=512)
    engine = llm.engine
    group = engine.make_group("copy", prompt, GREEDY.replace(max_tokens=2))
    engine.add_group(group)
    engine.step()  # the prompt, and every sample's first token
    parent, child = (engine.kv.block_tables(s.request_id)[0] for s in group.samples[:2])
    assert child[:2] == parent[:2] and child[2] != parent[2]
    cache = engine.runner.kv_caches[0]
    assert torch.equal(cache[child[2]], cache[parent[2]])
    assert all(s.num_output_tokens == 1 for s in group.samples)
    while engine.has_work():
        engine.step()
    assert engine.kv.usage == 0.0


def test_deepseek_v4_samples_fork_window_compressed_and_state_groups(v4_dir):
    """DeepSeek-V4 (sliding window, CSA and HCA layers: compressed and state groups) forks every
    group and each sample equals itself alone, for prompts across the window and the ratios."""
    llm = LLM(v4_dir, block_size=8, max_model_len=256)
    kinds = {s.kind for s in llm.engine.kv_specs}
    assert {"sliding_window", "compressed", "state"} <= kinds
    for length, params in ((37, SEEDED), (24, GREEDY), (61, GREEDY)):
        prompt = mixed_prompts(500, (length,), seed=length)[0]
        got, computed = run(llm, prompt, params)
        assert got == alone(llm, prompt, params), length
        assert computed == length
    assert llm.engine.kv.usage == 0.0


def test_pool_too_small_to_fork_falls_back_to_computing(llama_dir):
    """With no block free for the copies the samples queue and compute their prompts (the prefix
    cache gives them the full blocks), with the same tokens."""
    prompt = mixed_prompts(256, (40,), seed=7)[0]  # 3 blocks of 16
    llm = LLM(llama_dir, block_size=16, max_model_len=64, num_kv_blocks=5, max_num_batched_tokens=64)
    engine = llm.engine
    got, computed = run(llm, prompt, GREEDY.replace(max_tokens=3))
    assert got == alone(llm, prompt, GREEDY.replace(max_tokens=3))
    assert computed > 40  # some sample computed (part of) its prompt again
    assert engine.kv.usage == 0.0


def test_samples_fork_when_sample_zero_ends_at_its_first_token(llama_dir):
    prompt = mixed_prompts(256, (30,), seed=8)[0]
    llm = LLM(llama_dir, block_size=16, max_model_len=512)
    one = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=1)
    got, computed = run(llm, prompt, one)
    assert got == alone(llm, prompt, one) and all(len(t) == 1 for t in got)
    assert computed == 30
    assert llm.engine.kv.usage == 0.0 and not llm.engine.groups


def test_kv_cache_manager_fork_shares_full_blocks_and_copies_partial_ones():
    specs = [KVGroupSpec("full", "full", 1, (2, 4, 1, 8), "float32", 4),
             KVGroupSpec("win", "sliding_window", 1, (2, 4, 1, 8), "float32", 4, sliding_window=4),
             KVGroupSpec("cmp", "compressed", 1, (4, 8), "float32", 4, compress_ratio=2),
             KVGroupSpec("st", "state", 1, (4, 8), "float32", 4)]
    kv = KVCacheManager(specs, [16, 16, 16, 16], hash_block_size=4)
    assert kv.allocate("p", 14)
    kv.free_skipped("p", 14)
    parent = [list(t) for t in kv.block_tables("p")]
    copies = kv.fork("p", "c", 14)
    child = kv.block_tables("c")
    # full: 3 full blocks shared, the 4th (2 of 4 entries) copied; window: old blocks null, the
    # partial one copied; compressed: 7 entries = 1 full block + a partial; state: the last copied
    for g in range(4):
        assert child[g][:-1] == parent[g][:-1] and child[g][-1] != parent[g][-1]
        assert copies[g] == [(parent[g][-1], child[g][-1])]
    assert child[1][0] == 0 and child[3][:3] == [0, 0, 0]
    assert all(kv.pools[0].ref_count(b) == 2 for b in parent[0][:3])
    kv.free("p")
    kv.free("c")
    assert kv.usage == 0.0
    tight = KVCacheManager(specs[:1], [5], hash_block_size=4)
    assert tight.allocate("p", 14)  # takes all 4 blocks
    assert tight.fork("p", "c", 14) is None and "c" not in tight.tables
    assert [tight.pools[0].ref_count(b) for b in tight.block_tables("p")[0]] == [1, 1, 1, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "deepseek_v4"])
def test_samples_fork_on_the_gpu_in_graphs(tmp_path, family):
    """On a GPU, decode in captured graphs and pipelined: the forked blocks are bit-equal copies
    right after the prompt step, and every sample (float32) equals itself computed alone."""
    path = str(tmp_path / family)
    if family == "llama":
        make_checkpoint(path, "llama", max_position_embeddings=1024)
        settings: dict = dict(attention_backend="triton")
    else:
        make_v4_checkpoint(path, "csa_hca")
        settings = {}
    llm = LLM(path, block_size=16, dtype="float32", max_num_seqs=8, max_model_len=512, **settings)
    engine = llm.engine
    assert engine.runner.graphs is not None
    prompt = mixed_prompts(300, (45,), seed=9)[0]  # 2 full blocks of 16 and 13 tokens
    group = engine.make_group("gpu-fork", prompt, SEEDED)
    engine.add_group(group)
    engine.step()
    assert all(s.num_output_tokens == 1 for s in group.samples)
    for g, cache in enumerate(engine.runner.kv_caches):
        parent = engine.kv.block_tables(group.samples[0].request_id)[g]
        for child in group.samples[1:]:
            table = engine.kv.block_tables(child.request_id)[g]
            for a, b in zip(parent, table):
                if a != b:
                    assert torch.equal(cache[a], cache[b]), (g, a, b)
    while engine.has_work():
        engine.step()
    assert [list(s.output_token_ids) for s in group.samples] == alone(llm, prompt, SEEDED)
    for params in (SEEDED, GREEDY):
        engine.kv.reset_prefix_cache()
        got, computed = run(llm, prompt, params)
        assert got == alone(llm, prompt, params)
        assert computed == 45
    assert engine.num_pipelined_steps > 0 and engine.kv.usage == 0.0
