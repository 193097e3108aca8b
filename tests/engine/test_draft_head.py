"""speculative_method=draft_head: the head's paged forward equals its dense (training) forward, the
dense target forward equals the engine's, and with a head trained here on a small random model's
own greedy text (so its drafts are often right) the output equals decoding without speculation
token for token, through chunked prefill, prefix caching, preemption, n samples, penalties,
stop strings, logprobs and aborts, with every block freed. The committed SmolLM2 head gives real
acceptance; bad head files and models it cannot serve are refused by name; a prefill engine
hands the head's state to decode, which then recomputes nothing of the prompt. A draft vocabulary
(the tokens the head may draft) changes drafts, never output, and bad ones are refused."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from cluster import LLM, SamplingParams
from cluster.common.errors import ModelLoadError, UnsupportedSettingError
from cluster.engine.draft_runner import DraftHeadRunner
from cluster.models.draft_head import VOCAB_FORMAT, LlamaDraftHead, dense_hidden, draft_vocab_path, head_metadata
from tests.factories import engine_logits, generate_disaggregated, local_pd_workers, make_checkpoint, mixed_prompts, \
    output_summary, run_with_aborts

K = 3


def train_head(llm: LLM, seqs: list[list[int]], steps: int, seed: int = 0) -> LlamaDraftHead:
    from bench.train_draft_head import chain_losses
    torch.manual_seed(seed)
    target = llm.engine.model
    head = LlamaDraftHead(target.args, target.args.num_layers, torch.float32)
    head.init_from_target(target)
    dev = target.embed_tokens.weight.device
    head = head.to(dev)
    params = list(head.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95))
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    ids, lengths = ids.to(dev), torch.tensor([len(s) for s in seqs], device=dev)
    for _ in range(steps):
        loss, _, _ = chain_losses(head, target, target.embed_tokens.weight, ids, lengths, K, train=True)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    for p in params:
        p.requires_grad_(False)
    return head


def save_head(head: LlamaDraftHead, path: str, **meta) -> str:
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, path,
              metadata=head_metadata(head.args, "tiny-random", **meta))
    return path


def train_prompts() -> list[list[int]]:
    return mixed_prompts(300, (5, 9, 17, 30) * 5, seed=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small random Llama and a draft head trained on its own greedy continuations."""
    root = tmp_path_factory.mktemp("draft")
    path = str(root / "llama")
    make_checkpoint(path, "llama", seed=11)
    llm = LLM(path, block_size=4)
    prompts = train_prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    head = train_head(llm, [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)], steps=120)
    return path, save_head(head, str(root / "head.safetensors"))


summary = output_summary


def head_llm(tiny, **kwargs) -> LLM:
    path, head = tiny
    return LLM(path, **{"block_size": 4, **kwargs}, speculative_method="draft_head", num_speculative_tokens=K,
               speculative_model=head)


# --- the head's forwards ----------------------------------------------------------------------------

def test_paged_forward_over_chunks_equals_the_dense_forward(tiny):
    llm = LLM(tiny[0], block_size=4, speculative_method="draft_head", speculative_model=tiny[1])
    engine = llm.engine
    drafter: DraftHeadRunner = engine.runner.drafter
    head, target = drafter.head.module, engine.model
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (23,), generator=gen)
    hidden = torch.randn(23, target.args.hidden_size, generator=gen)
    with torch.no_grad():
        want = head.forward_dense(target.embed_tokens(ids)[None], hidden[None])[0]
    table = list(range(1, 8))  # blocks 1..7 of 4 tokens: positions 0..27
    got = []
    for start, end in ((0, 9), (9, 10), (10, 23)):  # a chunk, one token, the rest
        got.append(drafter._pass([(start, end - start, table)], ids[start:end], hidden[start:end]))
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)


def test_dense_target_forward_equals_the_engine(tiny):
    llm = LLM(tiny[0], block_size=4)
    ids = mixed_prompts(300, (21,), seed=6)[0]
    model = llm.engine.model
    with torch.no_grad():
        dense = model.compute_logits(dense_hidden(model, torch.tensor([ids]))[0])
    torch.testing.assert_close(dense, engine_logits(llm, ids, chunk=8), rtol=1e-4, atol=1e-4)


# --- exact output -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["plain", "chunked", "no_prefix_cache", "preempting"])
def test_draft_head_equals_no_speculation(tiny, case):
    prompts = train_prompts()[:8] + mixed_prompts(300, (6, 25), seed=9)
    prompts.append(prompts[3][:16] + [11, 12])  # a prefix hit on prompt 3's blocks
    settings = {"plain": {}, "chunked": {"max_num_batched_tokens": 8},
                "no_prefix_cache": {"enable_prefix_caching": False},
                "preempting": {"num_kv_blocks": 60, "max_num_batched_tokens": 32}}[case]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=30, n=3),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # max_tokens inside a run
        SamplingParams(temperature=1.0, seed=2, max_tokens=25, repetition_penalty=1.2, presence_penalty=0.3,
                       frequency_penalty=0.2, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=9, min_tokens=12, max_tokens=20, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=36, n=2, ignore_eos=True),
    ]
    params = [params[i % len(params)] for i in range(len(prompts))]
    want = summary(LLM(tiny[0], block_size=4, **settings).generate(prompts, params))
    llm = head_llm(tiny, **settings)
    assert summary(llm.generate(prompts, params)) == want
    engine = llm.engine
    stats = engine.spec_stats
    assert stats.num_accepted_tokens > max(20, 0.05 * stats.num_draft_tokens)  # the trained head is right at times
    if case == "preempting":
        assert engine.scheduler.num_preemptions > 0
    assert engine.kv.usage == 0.0 and not engine.runner.drafter.states


def test_sampled_requests_draw_their_drafts_with_the_targets_noise(tiny):
    """speculative_draft_sampling="coupled" (the default): a sampled request's drafts are drawn
    from the head's distribution with the noise its verify step draws with, so they are accepted
    far more often than the head's argmax at temperature 1; outputs equal decoding without
    speculation either way (seeded, token for token)."""
    prompts = train_prompts()[:8]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=32, n=2, ignore_eos=True)
    want = summary(LLM(tiny[0], block_size=4).generate(prompts, params))
    rate = {}
    for mode in ("greedy", "coupled"):
        llm = head_llm(tiny, speculative_draft_sampling=mode)
        assert summary(llm.generate(prompts, params)) == want
        stats, drafter = llm.engine.spec_stats, llm.engine.runner.drafter
        rate[mode] = stats.num_accepted_tokens / stats.num_draft_tokens
        assert (drafter.num_sampled_drafts > 0) == (mode == "coupled")
        row = [r for r in llm.engine.backends() if r["component"] == "draft_head"][0]
        assert ("coupled" in row["reason"]) == (mode == "coupled"), row
        assert llm.engine.kv.usage == 0.0
    assert rate["coupled"] > 1.2 * rate["greedy"], rate
    with pytest.raises(UnsupportedSettingError, match="speculative_draft_sampling"):
        head_llm(tiny, speculative_draft_sampling="typical")


def test_stop_strings_inside_an_accepted_run(tiny):
    prompts = train_prompts()[:3]
    base = LLM(tiny[0], block_size=4).generate(prompts, SamplingParams(temperature=0.0, max_tokens=40,
                                                                         ignore_eos=True))
    params = []
    for o in base:
        text = o.outputs[0].text
        params.append(SamplingParams(temperature=0.0, max_tokens=40, stop=[text[len(text) // 2:len(text) // 2 + 3]],
                                     ignore_eos=True))
    params[2] = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[base[2].outputs[0].token_ids[17]])
    want = summary(LLM(tiny[0], block_size=4).generate(prompts, params))
    assert summary(head_llm(tiny).generate(prompts, params)) == want


def test_many_requests_with_aborts_free_every_block(tiny):
    llm = head_llm(tiny, max_num_batched_tokens=32)
    engine = llm.engine
    run_with_aborts(engine, train_prompts())
    assert engine.kv.usage == 0.0 and not engine.groups and not engine.runner.drafter.states
    assert engine.spec_stats.num_accepted_tokens > 0


def test_metrics_and_backends_report_the_head(tiny):
    llm = head_llm(tiny)
    llm.generate(train_prompts()[:4], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    counters = llm.engine.counters()
    assert counters["draft_head_passes_total"] > 0 and counters["draft_head_positions_total"] > 0
    assert counters["spec_decode_num_accepted_tokens_total"] > 0
    rows = {r["component"]: r for r in llm.engine.backends()}
    assert rows["speculative_decoding"]["impl"] == "draft_head"
    assert rows["draft_head"]["impl"] == "eager" and "eager" in rows["draft_head"]["reason"]
    # the head's KV is one more layer of the model's group
    assert llm.engine.kv_specs[0].num_layers == llm.engine.model.args.num_layers + 1


# --- the committed head ----------------------------------------------------------------------------

def test_the_committed_smollm2_head_drafts_real_text():
    """The shipped head (bench/train_draft_head.py on an H200) on the served SmolLM2: about half
    its first drafts or more are right on chat replies, about two tokens a step. Exactness is the
    tests above' business (this model's CPU kernels are not batch-invariant at every near-tie, and
    which reply a chat gets moves with the CPU's GEMM: 38 of 67 first drafts right where oneDNN
    multiplies bfloat16 natively, 34 of 68 where the dense copies are float32, one reply ending
    at another token)."""
    llm = LLM("smollm2", speculative_method="draft_head", num_speculative_tokens=K, max_model_len=512)
    chats = [[{"role": "user", "content": c}] for c in
             ("Explain photosynthesis in simple terms.", "Give me five tips for learning a language.",
              "Write a Python function that reverses a string, with comments.")]
    llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=48))
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 10
    assert stats.accepted_per_pos[0] >= 0.45 * stats.num_drafts, stats.counters()
    assert stats.mean_accepted_length > 1.7, stats.counters()
    head = llm.engine.runner.drafter.head
    assert head.vocab_ids is not None and head.vocab_ids.numel() == 8192  # the vocabulary shipped beside it
    assert head._q8 is not None  # drafted through the int8 logits kernel, over its rows only
    assert head.module.fc.quantized is not None  # its projections in the target's 4-bit format
    exact = LLM("smollm2", dtype="float32", speculative_method="draft_head", max_model_len=256)
    assert exact.engine.runner.drafter.head.module.fc.quantized is None  # the float32 path stays float


# --- refusals ---------------------------------------------------------------------------------------

def test_bad_heads_and_models_are_refused(tiny, tmp_path):
    path, good = tiny
    with pytest.raises(ModelLoadError, match="do not exist"):
        LLM(path, speculative_method="draft_head", speculative_model=str(tmp_path / "none.safetensors"))
    with pytest.raises(UnsupportedSettingError, match="speculative_model"):
        LLM(path, speculative_method="draft_head")  # no head ships for this model
    from safetensors import safe_open
    with safe_open(good, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    wrong = dict(meta, hidden_size="999")
    save_file(tensors, str(tmp_path / "wrong.safetensors"), metadata=wrong)
    with pytest.raises(ModelLoadError, match="hidden_size"):
        LLM(path, speculative_method="draft_head", speculative_model=str(tmp_path / "wrong.safetensors"))
    short = {k: v for k, v in tensors.items() if k != "fc.weight"}
    save_file(short, str(tmp_path / "short.safetensors"), metadata=meta)
    with pytest.raises(ModelLoadError, match="fc.weight"):
        LLM(path, speculative_method="draft_head", speculative_model=str(tmp_path / "short.safetensors"))
    bent = dict(tensors, **{"fc.weight": tensors["fc.weight"][:, :-1].contiguous()})
    save_file(bent, str(tmp_path / "bent.safetensors"), metadata=meta)
    with pytest.raises(ModelLoadError, match="shape"):
        LLM(path, speculative_method="draft_head", speculative_model=str(tmp_path / "bent.safetensors"))
    save_file(tensors, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ModelLoadError, match="not a draft head"):
        LLM(path, speculative_method="draft_head", speculative_model=str(tmp_path / "plain.safetensors"))
    from tests.deepseek_factories import make_v4_checkpoint
    v4 = str(tmp_path / "v4")
    make_v4_checkpoint(v4, "csa_hca")
    with pytest.raises(UnsupportedSettingError, match="one full-attention KV group"):
        LLM(v4, block_size=4, speculative_method="draft_head", speculative_model=good)


# --- disaggregated: the hand-over ------------------------------------------------------------------

def test_prefill_hands_the_head_its_state_and_decode_recomputes_nothing(tiny):
    path, head = tiny
    prompts = train_prompts()[:6]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with local_pd_workers({"model": path, "block_size": 4, "max_num_batched_tokens": 16,
                           "speculative_method": "draft_head", "num_speculative_tokens": K,
                           "speculative_model": head, "enable_prefix_caching": False}) as (prefill, decode):
        got = generate_disaggregated(decode, prompts, params)
        want = [o.outputs[0].token_ids for o in LLM(path, block_size=4).generate(prompts, params)]
        assert got == want
        engine = decode.engine.engine
        drafter = engine.runner.drafter
        assert drafter.num_seeded == len(prompts)  # every request's state came from the prefill worker
        assert drafter.num_cold_starts == 0
        # decode ran the head over generated positions only: at most one per output token, plus
        # the chained draft positions of each verify step
        outputs = sum(len(t) for t in got)
        assert drafter.num_positions <= outputs + (K - 1) * engine.spec_stats.num_drafts
        assert engine.spec_stats.num_accepted_tokens > 0
        assert prefill.engine.engine.runner.drafter.num_positions >= sum(len(p) for p in prompts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_draft_head_on_the_gpu_equals_graph_decode(tmp_path):
    """On a GPU (float32, Triton attention): the head's proposals (replayed from the draft
    graphs, through the model's attention kernel) and the verify steps (replayed from the decode graphs) give the tokens of
    pipelined graph decode without speculation, greedy and seeded, n samples included."""
    path = str(tmp_path / "llama")
    make_checkpoint(path, "llama", seed=11, max_position_embeddings=1024)
    settings = dict(block_size=16, dtype="float32", max_num_seqs=8, max_model_len=512, attention_backend="triton")
    base = LLM(path, **settings)
    prompts = train_prompts()[:6]
    outs = base.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    head = train_head(base, [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)], steps=1)
    head_path = save_head(head.cpu(), str(tmp_path / "head.safetensors"))
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30, n=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, ignore_eos=True)]
    params = [params[i % 3] for i in range(len(prompts))]
    want = summary(base.generate(prompts, params))
    assert base.engine.num_pipelined_steps > 0
    llm = LLM(path, speculative_method="draft_head", num_speculative_tokens=K, speculative_model=head_path, **settings)
    assert llm.engine.runner.graphs is not None
    graph_steps, eager_steps = llm.engine.runner.num_graph_steps, llm.engine.runner.num_eager_steps
    assert summary(llm.generate(prompts, params)) == want
    assert llm.engine.spec_stats.num_drafts > 0 and llm.engine.runner.drafter.num_passes > 0
    # every step but the prompts' replayed a graph (num_drafts counts requests, not steps)
    assert llm.engine.runner.num_graph_steps - graph_steps >= 10
    assert llm.engine.runner.num_eager_steps - eager_steps <= 4
    drafter = llm.engine.runner.drafter  # the proposals replayed the draft graphs
    assert drafter.graph_status.captured, drafter.graph_status.describe()
    assert drafter.num_graph_proposals > 10 and drafter.num_eager_proposals == 0
    assert llm.engine.kv.usage == 0.0


def test_proposals_replay_emulated_draft_graphs(tiny, monkeypatch):
    """On the CPU, the head's proposals replayed from emulated draft graphs (their static
    buffers, padding rows and requests, the Triton kernels interpreted, every replay checked
    for host reads): the drafts are the eager passes' and the output is decoding's without
    speculation, greedy and seeded, n samples and requests drafting fewer than k tokens included."""
    settings = dict(block_size=16, dtype="float32", attention_backend="triton", max_num_seqs=4, max_model_len=128)
    prompts = train_prompts()[:3] + [train_prompts()[5][:9]]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=14, n=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),  # fewer than k drafts at its end
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    want = summary(LLM(tiny[0], **settings).generate(prompts, params))
    llm = head_llm(tiny, enforce_eager=True, **settings)
    engine, drafter = llm.engine, llm.engine.runner.drafter
    assert not drafter.graph_status.captured and "enforce_eager" in drafter.graph_status.reason
    assert engine.runner.capture_cuda_graphs(4 * (1 + K), 128, emulate=True).captured
    engine._capture_draft_graphs(emulate=True)
    assert drafter.graph_status.captured, drafter.graph_status.describe()
    assert drafter.graphs.sizes == [1, 2, 4]
    compared = {"drafts": 0, "agree": 0, "padded": 0}
    run = drafter.graphs.run

    def checked(jobs, states, tables, draws):
        eager = drafter._eager_proposal(jobs, states, tables, draws)  # writes the same draft KV, same values
        got = run(jobs, states, tables, draws).tolist()
        for job, a, b in zip(jobs, eager, got):
            compared["drafts"] += job.num_tokens
            compared["agree"] += sum(x == y for x, y in zip(a[:job.num_tokens], b[:job.num_tokens]))
            compared["sampled"] += job.num_tokens if job.noise is not None else 0
        compared["padded"] += len(jobs) not in drafter.graphs.sizes or any(j.num_tokens < K for j in jobs)
        return torch.tensor(got)
    compared["sampled"] = 0
    monkeypatch.setattr(drafter.graphs, "run", checked)
    assert summary(llm.generate(prompts, params)) == want
    assert drafter.num_graph_proposals > 5 and drafter.num_eager_proposals == 0
    assert compared["agree"] == compared["drafts"] > 0 and compared["padded"] > 0
    # the seeded samples' drafts were drawn in the graphs, from their noise, as the eager passes draw
    assert drafter.graphs.draws and 0 < compared["sampled"] == drafter.num_sampled_drafts < compared["drafts"]
    assert engine.spec_stats.num_accepted_tokens > 5
    row = [r for r in engine.backends() if r["component"] == "draft_head"][0]
    assert row["impl"] == "graph" and "verified" in row["reason"]
    assert engine.metrics()["draft_head_graphs_captured"] == 1.0
    assert engine.counters()["draft_head_graph_proposals_total"] == drafter.num_graph_proposals
    assert engine.kv.usage == 0.0 and not drafter.states


def test_a_failing_draft_head_costs_acceptance_not_output(tiny, monkeypatch):
    """The head raising mid-step (a bug, memory): that step verifies its placeholder drafts, the
    request states start afresh, and every output still equals decoding without speculation."""
    prompts = train_prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = summary(LLM(tiny[0], block_size=4).generate(prompts, params))
    llm = head_llm(tiny)
    drafter = llm.engine.runner.drafter
    real = drafter.propose
    calls = {"n": 0}

    def flaky(jobs, tables):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("injected draft failure")
        return real(jobs, tables)
    monkeypatch.setattr(drafter, "propose", flaky)
    assert summary(llm.generate(prompts, params)) == want
    assert calls["n"] >= 6 and llm.engine.spec_stats.num_accepted_tokens > 0
    assert llm.engine.kv.usage == 0.0 and not drafter.states


def test_a_block_is_cached_only_once_the_head_has_written_it(tiny):
    """The head's layer lags the target's by up to k + 1 positions after a verify step; a block
    enters the prefix cache only once both are written, so a later hit never reads stale draft KV."""
    llm = head_llm(tiny)
    engine = llm.engine
    drafter = engine.runner.drafter
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(train_prompts()[:4]):
        engine.add_request(f"c{i}", p, params)
    lagged = checked = 0
    while engine.has_work():
        engine.step()
        for r in engine.scheduler.running:
            upto = drafter.written_upto(r.request_id)
            if upto is None:
                continue
            cached = engine.kv._num_cached_blocks[r.request_id][0]
            assert cached * 4 <= upto, (r.request_id, cached, upto)
            lagged += r.num_computed_tokens // 4 > upto // 4  # a full block the head has not finished
            checked += 1
    assert checked > 20 and lagged > 0  # the rule was exercised
    assert engine.kv.usage == 0.0


# --- the draft vocabulary ---------------------------------------------------------------------------

def save_vocab(path: str, ids: list[int], vocab_size: int, meta: dict[str, str] | None = None) -> str:
    save_file({"token_ids": torch.tensor(ids, dtype=torch.int64)}, path,
              metadata={"format": VOCAB_FORMAT, "vocab_size": str(vocab_size), **(meta or {})})
    return path


def frequent_ids(tiny, share: float) -> tuple[list[int], int]:
    """The ids the tiny model writes most (greedy, on the head's training prompts), the top
    ``share`` of those it writes at all, and its vocabulary size."""
    llm = LLM(tiny[0], block_size=4)
    outs = llm.generate(train_prompts()[:40], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    counts: dict[int, int] = {}
    for o in outs:
        for t in o.outputs[0].token_ids:
            counts[t] = counts.get(t, 0) + 1
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    return ranked[:max(1, int(len(ranked) * share))], int(llm.engine.model.args.vocab_size)


def test_a_draft_vocabulary_changes_drafts_not_output(tiny, tmp_path):
    """Drafting over the tokens the model writes most: every draft is one of them, the argmax of
    the full logits over those rows; the output equals decoding without speculation (greedy,
    seeded, n samples); acceptance stays; a vocabulary next to the head loads by itself and
    "full" turns it off."""
    ids, vocab_size = frequent_ids(tiny, 0.6)
    path = save_vocab(str(tmp_path / "v.safetensors"), ids, vocab_size)
    prompts = train_prompts()[:6] + mixed_prompts(300, (7,), seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, max_tokens=24, n=2, ignore_eos=True)]
    params = [params[i % 2] for i in range(len(prompts))]
    want = summary(LLM(tiny[0], block_size=4).generate(prompts, params))
    llm = head_llm(tiny, speculative_draft_vocab=path)
    head = llm.engine.runner.drafter.head
    assert head.vocab_ids is not None and head.vocab_ids.tolist() == ids
    drafted: list[int] = []
    sampled: list[int] = []
    real = head.draft_tokens

    def spied(g, scale=None, gumbel=None):
        tokens = real(g, scale, gumbel)
        full = head.draft_logits(g)
        allowed = torch.tensor(ids)
        if gumbel is None:
            assert torch.equal(tokens, allowed[full[:, allowed].argmax(dim=-1)])  # the argmax over the subset
        else:  # a sampled request's draw over the subset (a greedy one's scale 1 and noise 0 in the batch)
            assert torch.equal(tokens, allowed[(full[:, allowed] * scale[:, None] + gumbel).argmax(dim=-1)])
            sampled.append(int((gumbel != 0).any(dim=-1).sum()))
        drafted.extend(tokens.tolist())
        return tokens
    head.draft_tokens = spied
    assert summary(llm.generate(prompts, params)) == want
    assert drafted and set(drafted) <= set(ids) and sum(sampled) > 0
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > max(10, 0.05 * stats.num_draft_tokens), stats.counters()
    assert llm.engine.kv.usage == 0.0 and not llm.engine.runner.drafter.states

    # beside the head: loaded by default; "full" drafts over everything
    beside = tmp_path / "beside"
    beside.mkdir()
    head_path = str(beside / "head.safetensors")
    with open(tiny[1], "rb") as src, open(head_path, "wb") as dst:
        dst.write(src.read())
    save_vocab(draft_vocab_path(head_path), ids, vocab_size)
    auto = LLM(tiny[0], block_size=4, speculative_method="draft_head", speculative_model=head_path)
    assert auto.engine.runner.drafter.head.vocab_ids.tolist() == ids
    full = LLM(tiny[0], block_size=4, speculative_method="draft_head", speculative_model=head_path,
               speculative_draft_vocab="full")
    assert full.engine.runner.drafter.head.vocab_ids is None
    assert summary(full.generate(prompts[:2], params[:2])) == want[:2]


def test_bad_draft_vocabularies_are_refused(tiny, tmp_path):
    ids, vocab_size = frequent_ids(tiny, 0.5)
    cases = {
        "does not exist": None,
        "not a draft vocabulary": {"format": "something/1"},
        "counted for vocab_size": {"vocab_size": str(vocab_size + 1)},
        "distinct ids": "dup",
        "in \\[0": "range",
    }
    for match, bad in cases.items():
        path = str(tmp_path / f"{len(match)}.safetensors")
        if bad == "dup":
            save_vocab(path, ids + ids[:1], vocab_size)
        elif bad == "range":
            save_vocab(path, ids + [vocab_size], vocab_size)
        elif isinstance(bad, dict):
            save_vocab(path, ids, vocab_size, bad)
        with pytest.raises(ModelLoadError, match=match):
            head_llm(tiny, speculative_draft_vocab=path)
