"""Speculative decoding never changes greedy or seeded output, token for token: with proposers that
are always right, always wrong, or right then wrong at every offset, with the n-gram proposer,
through chunked prefill, prefix caching, preemption, n samples, stop strings, max_tokens landing
inside an accepted run, penalties, min_tokens and logprobs. Unseeded sampling keeps the target's
distribution (chi-square on a 6-token vocabulary against the model's exact probabilities). No
block is left allocated, and no block table or prefix-cache entry ever holds a rejected token."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.common.errors import UnsupportedSettingError
from cluster.engine.spec_decode import NgramProposer, ngram_lookup
from tests.factories import engine_logits, make_checkpoint, mixed_prompts, output_summary, run_with_aborts

K = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    make_checkpoint(path, "llama", seed=11)
    return path


summary = output_summary


class Oracle:
    """Knows each prompt's reference output: proposes it right for the first ``right`` drafts of
    every step, then wrong (None: always right)."""

    name = "oracle"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], right: int | None, vocab: int) -> None:
        self.reference = reference
        self.right = right
        self.vocab = vocab

    def propose(self, request, k):
        ref = self.reference[tuple(request.prompt_token_ids)]
        done = request.num_output_tokens
        truth = ref[done:done + k]
        right = len(truth) if self.right is None else min(self.right, len(truth))
        return truth[:right] + [(t + 1) % self.vocab for t in truth[right:]]

    def forget(self, request_id):
        pass


def spec_llm(model_dir, proposer=None, k=K, **kwargs):
    llm = LLM(model_dir, block_size=4, speculative_method="ngram", num_speculative_tokens=k, **kwargs)
    if proposer is not None:
        llm.engine.proposer = proposer
    return llm


def test_ngram_lookup_finds_the_latest_longest_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3])
    assert ngram_lookup(tokens, 3, 1, 3) == [7, 5, 1]  # latest "1 2 3" is at 4..6
    assert ngram_lookup(np.array([4, 5, 6, 4, 5]), 4, 1, 3) == [6, 4, 5]
    assert ngram_lookup(np.array([1, 2, 3, 4]), 2, 1, 3) == []  # nothing repeats
    assert ngram_lookup(np.array([1, 2, 3, 1, 2, 8, 2]), 2, 1, 2) == [8, 2]  # no earlier "8 2"; the latest "2"
    assert ngram_lookup(np.array([5, 5, 5]), 3, 2, 2) == [5]
    proposer = NgramProposer(2, 3)

    class R:
        request_id = "r"
        all_token_ids = [1, 2, 3, 1, 2]
    assert proposer.propose(R, 2) == [3, 1]
    R.all_token_ids = R.all_token_ids + [3]
    assert proposer.propose(R, 2) == [1, 2]  # the context grew in place
    R.all_token_ids = [9, 8, 9, 8]  # shorter: a new context (a request recomputed from scratch)
    assert proposer.propose(R, 2) == [9, 8]


@pytest.mark.parametrize("right", [None, 0, 1, 2, 3])
def test_greedy_output_is_unchanged_whatever_the_drafts(model_dir, right):
    prompts = mixed_prompts(300, (3, 9, 17, 33, 21), seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)
    base = LLM(model_dir, block_size=4).generate(prompts, params)
    reference = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, base)}
    llm = spec_llm(model_dir, Oracle(reference, right, 300), max_num_batched_tokens=16)
    got = llm.generate(prompts, params)
    assert summary(got) == summary(base)
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0
    if right is None:
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # every draft right, all taken
        assert stats.mean_accepted_length > 3.0
    else:
        assert stats.num_accepted_tokens <= right * stats.num_drafts
        assert stats.accepted_per_pos[right:] == [0] * (K - right)
    assert llm.engine.kv.usage == 0.0


def looping_prompts() -> list[list[int]]:
    rng = random.Random(3)
    loop = [rng.randrange(10, 300) for _ in range(6)]
    return [loop * 5, [rng.randrange(10, 300) for _ in range(30)] + loop * 3, loop * 2 + [7, 8, 9]]


@pytest.mark.parametrize("case", ["plain", "chunked", "no_prefix_cache", "preempting"])
def test_ngram_equals_no_speculation(model_dir, case):
    prompts = looping_prompts() + mixed_prompts(300, (5, 40), seed=2)
    prompts.append(prompts[0][:24] + [11, 12])  # a prefix hit on prompt 0's blocks
    settings = {"plain": {}, "chunked": {"max_num_batched_tokens": 8},
                "no_prefix_cache": {"enable_prefix_caching": False},
                "preempting": {"num_kv_blocks": 40, "max_num_batched_tokens": 32}}[case]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=30, n=3),  # seeded samples
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # max_tokens inside a run
        SamplingParams(temperature=1.0, seed=2, max_tokens=25, repetition_penalty=1.2, presence_penalty=0.3,
                       frequency_penalty=0.2, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=9, min_tokens=12, max_tokens=20, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=2, ignore_eos=True),
    ]
    base_llm = LLM(model_dir, block_size=4, **settings)
    base = base_llm.generate(prompts, params)
    llm = spec_llm(model_dir, **settings)
    got = llm.generate(prompts, params)
    assert summary(got) == summary(base)
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > 10  # the loops are found
    if case == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.usage == 0.0


def test_stop_strings_and_stop_tokens_inside_an_accepted_run(model_dir):
    prompts = looping_prompts()
    base = LLM(model_dir, block_size=4).generate(prompts, SamplingParams(temperature=0.0, max_tokens=40,
                                                                           ignore_eos=True))
    stops = []
    for o in base:
        text, ids = o.outputs[0].text, o.outputs[0].token_ids
        stops.append((text[len(text) // 2:len(text) // 2 + 3], ids[17]))
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=[s], ignore_eos=True) for s, _ in stops[:2]]
    params.append(SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stops[2][1]]))
    want = summary(LLM(model_dir, block_size=4).generate(prompts, params))
    llm = spec_llm(model_dir)
    assert summary(llm.generate(prompts, params)) == want
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_no_table_or_prefix_cache_entry_holds_a_rejected_token(model_dir):
    """After every step, each running request's tables cover exactly its computed (accepted) tokens,
    and every cached block's hash is that of the request's accepted tokens."""
    from cluster.common.block_hash import hash_token_blocks
    prompts = looping_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    base = LLM(model_dir, block_size=4).generate(prompts, params)
    reference = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, base)}
    llm = spec_llm(model_dir, Oracle(reference, 1, 300))  # one right, three rejected every step
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"t{i}", p, params)
    checked = 0
    while engine.has_work():
        engine.step()
        for r in engine.scheduler.running:
            tables = engine.kv.block_tables(r.request_id)
            for spec, table in zip(engine.kv_specs, tables):
                assert len(table) == spec.blocks_needed(r.num_computed_tokens)
            hashes = hash_token_blocks(r.all_token_ids, 4, [])
            for j, block in enumerate(tables[0][:r.num_computed_tokens // 4]):
                cached = engine.kv.pools[0]._block_hash.get(block)
                assert cached is None or cached == hashes[j]
            checked += 1
    assert checked > 10 and engine.kv.usage == 0.0
    assert engine.spec_stats.num_draft_tokens > 3 * engine.spec_stats.num_accepted_tokens


def test_many_requests_with_aborts_free_every_block(model_dir):
    llm = spec_llm(model_dir, max_num_batched_tokens=32)
    engine = llm.engine
    run_with_aborts(engine, looping_prompts() + mixed_prompts(300, (4, 12, 30), seed=8))
    assert engine.kv.usage == 0.0 and not engine.groups
    assert engine.spec_stats.num_accepted_tokens > 0


def test_refused_where_a_method_does_not_fit_the_model(tmp_path, model_dir):
    """mtp needs a model with an MTP layer (DeepSeek-V4, and a checkpoint that has one); dspark
    a DeepSeek-V4 checkpoint with a DSpark drafter; bad n-gram bounds are named. (DeepSeek-V4's in-place state rolls back:
    tests/models/test_deepseek_v4_speculation.py.)"""
    from tests.deepseek_factories import make_v4_checkpoint
    path = str(tmp_path / "v4")
    make_v4_checkpoint(path, "csa_hca")
    with pytest.raises(UnsupportedSettingError, match="checkpoint has none"):
        LLM(path, block_size=4, speculative_method="mtp")
    with pytest.raises(UnsupportedSettingError, match="own draft layers .DeepSeek-V4.; LlamaForCausalLM has none"):
        LLM(model_dir, speculative_method="mtp")
    with pytest.raises(UnsupportedSettingError, match="own draft layers .DeepSeek-V4.; LlamaForCausalLM has none"):
        LLM(model_dir, speculative_method="dspark")
    with pytest.raises(UnsupportedSettingError, match="needs a DSpark checkpoint"):
        LLM(path, block_size=4, speculative_method="dspark")
    with pytest.raises(UnsupportedSettingError, match="prompt_lookup_max"):
        LLM(path, speculative_method="ngram", prompt_lookup_min=4, prompt_lookup_max=2)


def test_metrics_and_backends_report_speculation(model_dir):
    llm = spec_llm(model_dir)
    llm.generate(looping_prompts(), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    counters = llm.engine.counters()
    stats = llm.engine.spec_stats
    assert counters["spec_decode_num_drafts_total"] == stats.num_drafts > 0
    assert counters["spec_decode_num_accepted_tokens_total"] == sum(
        counters[f"spec_decode_num_accepted_tokens_pos{j}_total"] for j in range(K))
    # per request, in its RequestOutput.metrics (summed over its samples): together the engine's totals
    outs = llm.generate(looping_prompts(), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2))
    before = counters
    counters = llm.engine.counters()
    keys = {"drafts": "spec_num_drafts", "draft_tokens": "spec_num_draft_tokens",
            "accepted_tokens": "spec_num_accepted_tokens"}
    for name, key in keys.items():
        total = counters[f"spec_decode_num_{name}_total"] - before[f"spec_decode_num_{name}_total"]
        assert sum(o.metrics[key] for o in outs) == total > 0
    for o in outs:
        m = o.metrics
        assert m["spec_num_accepted_tokens"] <= m["spec_num_draft_tokens"] <= K * m["spec_num_drafts"]
        assert m["spec_mean_accepted_length"] == 1.0 + m["spec_num_accepted_tokens"] / m["spec_num_drafts"]
        per_pos = [m.get(f"spec_num_accepted_tokens_pos{j}", 0.0) for j in range(K)]
        assert sum(per_pos) == m["spec_num_accepted_tokens"] and per_pos == sorted(per_pos, reverse=True)
        # verify steps give at most their accepted drafts plus one token (fewer where max_tokens cuts a run)
        assert sum(len(c.token_ids) for c in o.outputs) >= m["spec_num_drafts"]
    assert any(o.metrics["spec_num_accepted_tokens"] > 0 for o in outs)
    plain_out = LLM(model_dir, block_size=4).generate(looping_prompts()[:1], SamplingParams(max_tokens=4))
    assert not any(k.startswith("spec_") for k in plain_out[0].metrics)
    row = [r for r in llm.engine.backends() if r["component"] == "speculative_decoding"]
    assert row and row[0]["impl"] == "ngram"
    plain = LLM(model_dir, block_size=4)
    assert not any(r["component"] == "speculative_decoding" for r in plain.engine.backends())
    assert "spec_decode_num_drafts_total" not in plain.engine.counters()


# --- temperature > 0: the target's distribution --------------------------------------------------

VOCAB = 6


@pytest.fixture(scope="module")
def tiny_vocab_dir(tmp_path_factory):
    import transformers
    path = str(tmp_path_factory.mktemp("vocab6"))
    torch.manual_seed(4)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64,
                                   tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.35)
    model.save_pretrained(path)
    return path


class RandomDrafts:
    name = "random"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def propose(self, request, k):
        return [self.rng.randrange(VOCAB) for _ in range(k)]

    def forget(self, request_id):
        pass


def exact_distributions(llm: LLM, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """P(t2) and P(t2, t3) of the model (temperature 1), marginalised over the first token t1."""
    def probs(ids):
        return engine_logits(llm, ids, chunk=64)[-1].double().softmax(-1).numpy()
    p1 = probs(prompt)
    p2 = np.zeros(VOCAB)
    p23 = np.zeros((VOCAB, VOCAB))
    for t1 in range(VOCAB):
        q2 = probs(prompt + [t1])
        p2 += p1[t1] * q2
        for t2 in range(VOCAB):
            p23[t2] += p1[t1] * q2[t2] * probs(prompt + [t1, t2])
    return p2, p23


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    from scipy import stats
    counts, probs = counts.ravel(), probs.ravel()
    expected = probs * counts.sum()
    return float(stats.chisquare(counts, expected).pvalue)


def assert_follow(outs, p2: np.ndarray, p23: np.ndarray) -> None:
    """The first and first two verified tokens of ``outs`` (after the prefill's) follow the
    model's ``P(t2)`` and ``P(t2, t3)`` (chi-square, p > 1e-3)."""
    firsts = np.zeros(VOCAB)
    pairs = np.zeros((VOCAB, VOCAB))
    for o in outs:
        t = o.outputs[0].token_ids
        firsts[t[1]] += 1
        pairs[t[1], t[2]] += 1
    assert chi_square_p(firsts, p2) > 1e-3
    assert chi_square_p(pairs, p23) > 1e-3


def test_unseeded_sampling_keeps_the_target_distribution(tiny_vocab_dir):
    """20,000 unseeded requests at temperature 1, speculating 2 random drafts per step: the
    distribution of the first token and of the first two tokens the verify step produces equals
    the model's (chi-square, p > 1e-3). The same test rejects a verifier biased by 1% of the mass
    (every draft of a token accepted once in a hundred regardless of the target)."""
    prompt = [1, 4, 2, 5]
    n = 20_000
    llm = LLM(tiny_vocab_dir, block_size=4, speculative_method="ngram", num_speculative_tokens=2,
              max_num_seqs=512, max_num_batched_tokens=4096, seed=1)
    llm.engine.proposer = RandomDrafts(7)
    p2, p23 = exact_distributions(llm, prompt)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    outs = [o for _ in range(n // 1000) for o in llm.generate([prompt] * 1000, params)]
    assert llm.engine.spec_stats.num_accepted_tokens > n // 10  # drafts are accepted at times
    assert_follow(outs, p2, p23)
    # power: a 1% shift of mass onto one token is detected at this many trials
    biased = p2 * 0.99
    biased[int(np.argmin(p2))] += 0.01
    assert chi_square_p(np.round(biased * n), p2) < 1e-3


def test_drafts_drawn_with_the_targets_noise_keep_the_target_distribution(tiny_vocab_dir, tmp_path):
    """Unseeded requests at temperature 1 whose drafts a draft head draws from its own
    distribution with the noise the verify step then draws with (drawn ahead, from the engine's
    generator: speculative_draft_sampling="coupled"): the first and first two verified tokens
    still follow the model's distribution (chi-square, p > 1e-3, as above)."""
    from safetensors.torch import save_file

    from cluster.models.draft_head import LlamaDraftHead, head_metadata
    prompt = [1, 4, 2, 5]
    n = 20_000
    target = LLM(tiny_vocab_dir, block_size=4).engine.model
    torch.manual_seed(2)
    head = LlamaDraftHead(target.args, target.args.num_layers, torch.float32)
    head.init_from_target(target)
    path = str(tmp_path / "head.safetensors")
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, path,
              metadata=head_metadata(head.args, "tiny-vocab6"))
    llm = LLM(tiny_vocab_dir, block_size=4, speculative_method="draft_head", speculative_model=path,
              num_speculative_tokens=2, max_num_seqs=512, max_num_batched_tokens=4096, seed=1)
    p2, p23 = exact_distributions(llm, prompt)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    outs = [o for _ in range(n // 1000) for o in llm.generate([prompt] * 1000, params)]
    assert llm.engine.runner.drafter.num_sampled_drafts > n
    assert llm.engine.spec_stats.num_accepted_tokens > n // 5  # drawn drafts are accepted often
    assert_follow(outs, p2, p23)


def test_seeded_requests_equal_their_non_speculative_output_exactly(tiny_vocab_dir):
    prompts = [[1, 4, 2, 5], [3, 3, 0], [5, 1]]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=12, ignore_eos=True)
              for t, s in ((1.0, 1), (0.6, 2), (1.3, 3))]
    want = summary(LLM(tiny_vocab_dir, block_size=4).generate(prompts, params))
    llm = LLM(tiny_vocab_dir, block_size=4, speculative_method="ngram", num_speculative_tokens=3)
    llm.engine.proposer = RandomDrafts(3)
    assert summary(llm.generate(prompts, params)) == want
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_the_default_k_follows_the_device(model_dir):
    """num_speculative_tokens unset: 3 on a CPU (a verify step's 4 rows, the CPU 4-bit kernel's
    cheapest batch past one), 4 on a GPU; set, it is kept."""
    from cluster.config import DEFAULT_SPECULATIVE_TOKENS, ModelConfig, resolve_speculative_tokens
    assert LLM(model_dir, block_size=4, speculative_method="ngram").engine.model_config.num_speculative_tokens == 3
    assert LLM(model_dir, block_size=4, speculative_method="ngram",
               num_speculative_tokens=5).engine.model_config.num_speculative_tokens == 5
    assert resolve_speculative_tokens(ModelConfig(), "cuda").num_speculative_tokens == DEFAULT_SPECULATIVE_TOKENS["cuda"] == 4
    with pytest.raises(UnsupportedSettingError, match="num_speculative_tokens"):
        ModelConfig(num_speculative_tokens=0)


def test_prefill_engines_never_draft(model_dir):
    from cluster.config import CacheConfig, ModelConfig, SchedulerConfig
    from cluster.engine.engine import LLMEngine
    engine = LLMEngine(ModelConfig(model=model_dir, speculative_method="ngram"), CacheConfig(block_size=4),
                       SchedulerConfig(role="prefill"))
    assert engine.proposer is None and engine.spec_stats is None
    assert "spec_decode_num_drafts_total" not in engine.counters()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ngram_on_the_gpu_equals_graph_decode(tmp_path):
    """On a GPU (float32): the n-gram verify steps, replayed from the decode graphs (one row per
    verified position), give the tokens of pipelined graph decode without speculation, greedy and
    seeded, n samples included, and say that their verify steps are not pipelined."""
    path = str(tmp_path / "llama")
    make_checkpoint(path, "llama", seed=11, max_position_embeddings=1024)
    settings = dict(block_size=16, dtype="float32", max_num_seqs=8, max_model_len=512, attention_backend="triton")
    prompts = looping_prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30, n=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, ignore_eos=True)]
    base = LLM(path, **settings)
    want = summary(base.generate(prompts, params))
    assert base.engine.num_pipelined_steps > 0
    llm = LLM(path, speculative_method="ngram", num_speculative_tokens=4, **settings)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.max_batch >= 8 * 5
    graph_steps = llm.engine.runner.num_graph_steps
    assert summary(llm.generate(prompts, params)) == want
    assert llm.engine.spec_stats.num_accepted_tokens > 10
    assert llm.engine.num_pipelined_steps == 0
    assert llm.engine.runner.num_graph_steps - graph_steps >= llm.engine.spec_stats.num_drafts // 2  # verify in graphs
    row = [r for r in llm.engine.backends() if r["component"] == "speculative_decoding"][0]
    assert "decode row" in row["reason"] and "verify steps synchronous" in row["reason"]
    assert llm.engine.kv.usage == 0.0


def test_verify_steps_replay_emulated_decode_graphs(tmp_path):
    """On the CPU, decode graphs emulated (their static buffers, the Triton kernels interpreted):
    verify steps are decode batches of one row per verified position, replayed from the graphs,
    with the tokens of eager decode without speculation, greedy and seeded."""
    path = str(tmp_path / "llama")
    make_checkpoint(path, "llama", seed=11, max_position_embeddings=256)
    settings = dict(block_size=16, dtype="float32", attention_backend="triton", max_num_seqs=4, max_model_len=256,
                    enforce_eager=True)
    prompts = [p[:30] for p in looping_prompts()]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)]
    want = summary(LLM(path, **settings).generate(prompts, params))
    llm = LLM(path, speculative_method="ngram", num_speculative_tokens=3, **settings)
    engine = llm.engine
    status = engine.runner.capture_cuda_graphs(4 * (1 + 3), engine.scheduler_config.max_model_len, emulate=True)
    assert status.captured, status.describe()
    assert summary(llm.generate(prompts, params)) == want
    assert engine.spec_stats.num_accepted_tokens > 5
    assert engine.runner.num_eager_steps == 1  # the prompts' step; every decode and verify step replayed a graph
    assert engine.runner.num_graph_steps > 3
