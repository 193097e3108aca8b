"""Pipelined speculative decoding (cluster/engine/spec_pipeline.py) on the CPU: verify steps and
the head's proposals replayed from emulated CUDA graphs (whole verify steps from the greedy
or sampled verify-step graph, cluster/engine/verify_step.py) (static buffers, padding rows, the Triton
kernels interpreted, host reads refused inside a replay), each step launched from the previous
one's results on the device before that one's tokens are read. Greedy output equals decoding
without speculation token for token, through stop strings and tokens, ``max_tokens`` inside an
accepted run, n samples, ``max_model_len``, requests that need synchronous steps, arrivals and
aborts mid-epoch; the drafts accepted are the synchronous verify steps'; every block and head
state is freed."""
from __future__ import annotations

import random

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.engine.spec_decode import SpecDecodeStats
from tests.engine.test_draft_head import K, head_llm, save_head, summary, tiny, train_head, train_prompts  # noqa: F401
from tests.factories import make_checkpoint

SETTINGS = dict(block_size=16, dtype="float32", attention_backend="triton", max_num_seqs=4, max_model_len=160)


def graph_llm(tiny, **kwargs) -> LLM:  # noqa: F811 - the fixture's value
    """The draft-head engine with emulated decode and draft graphs (captured by hand: a CPU has
    none), its verify steps pipelined."""
    settings = {**SETTINGS, **kwargs}
    llm = head_llm(tiny, enforce_eager=True, **settings)
    engine = llm.engine
    assert not engine._spec_pipelined and "CUDA graphs" in engine.spec_pipeline_status
    assert engine.runner.capture_cuda_graphs(4 * (1 + K), settings["max_model_len"], emulate=True).captured
    engine._capture_draft_graphs(emulate=True)  # the verify-step graphs too
    assert engine.runner.verify_graph_status.captured, engine.runner.verify_graph_status.describe()
    engine._init_spec_pipelining()
    assert engine._spec_pipelined and engine.spec_pipeline_status == ""
    return llm


def plain(tiny, **kwargs) -> LLM:  # noqa: F811
    return LLM(tiny[0], **{**SETTINGS, **kwargs})


def synchronous(llm: LLM, prompts, params) -> tuple[list, list[int]]:
    """``llm``'s outputs from synchronous verify steps (none pipelined), and the drafts accepted
    position by position; then its prefix cache emptied and its speculation totals zeroed, and
    its verify steps pipelined again: the same engine's pipelined run next starts where a fresh
    one would, without capturing its emulated graphs a second time (that capture, interpreted,
    was most of these tests' time)."""
    engine = llm.engine
    engine._spec_pipelined = False
    out = summary(llm.generate(prompts, params))
    assert engine.num_pipelined_verify_steps == 0 and engine.kv.usage == 0.0
    accepted = list(engine.spec_stats.accepted_per_pos)
    engine.kv.reset_prefix_cache()
    engine.spec_stats = SpecDecodeStats(K)
    engine._spec_pipelined = True
    return out, accepted


def test_greedy_output_equals_no_speculation(tiny):  # noqa: F811
    prompts = train_prompts()[:4]
    base = plain(tiny).generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    text = base[2].outputs[0].text
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),  # max_tokens inside a run
              SamplingParams(temperature=0.0, max_tokens=32, stop=[text[len(text) // 2:len(text) // 2 + 3]]),
              SamplingParams(temperature=0.0, max_tokens=28, n=2, ignore_eos=True,
                             stop_token_ids=[base[3].outputs[0].token_ids[21]])]
    want = summary(plain(tiny).generate(prompts, params))
    llm = graph_llm(tiny)
    engine = llm.engine
    drafter = engine.runner.drafter
    sync, sync_accepted = synchronous(llm, prompts, params)
    assert sync == want
    graph_proposals = drafter.num_graph_proposals
    assert summary(llm.generate(prompts, params)) == want
    assert engine.num_pipelined_verify_steps >= 10
    assert engine.runner.num_verify_graph_steps == engine.num_pipelined_verify_steps  # greedy: one graph a step
    # the device's proposals are the host's: the same drafts accepted, position by position
    assert engine.spec_stats.accepted_per_pos == sync_accepted
    assert engine.spec_stats.num_accepted_tokens > 10
    assert drafter.num_eager_proposals == 0
    assert drafter.num_graph_proposals - graph_proposals > engine.num_pipelined_verify_steps
    assert engine.counters()["spec_decode_pipelined_steps_total"] == engine.num_pipelined_verify_steps
    assert engine.metrics()["spec_decode_pipelined"] == 1.0 and engine.metrics()["spec_verify_graphs_captured"] == 1.0
    assert engine.counters()["spec_decode_verify_graph_steps_total"] == engine.runner.num_verify_graph_steps
    row = [r for r in engine.backends() if r["component"] == "speculative_decoding"][0]
    assert "verify steps pipelined" in row["reason"] and "one CUDA graph each: captured" in row["reason"]
    assert "batches with sampled requests (no top-k, top-p or min-p) too" in row["reason"]
    assert engine.metrics()["spec_verify_sampled_graphs_captured"] == 1.0
    assert engine.kv.usage == 0.0 and not drafter.states
    engine.step()  # generate returns once every request finished; the step in flight is read next
    assert engine._verify_in_flight is None and not engine.has_work()


def test_requests_that_need_host_data_and_the_context_limit(tiny):  # noqa: F811
    """A request with penalties and one with logprobs keep the batch synchronous while they run; a
    request that runs into max_model_len leaves the pipeline for its last steps."""
    prompts = train_prompts()[:3] + [train_prompts()[4] * 3]
    params = [SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, max_tokens=6, presence_penalty=0.5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)]  # stops at max_model_len
    want = summary(plain(tiny, max_model_len=64).generate(prompts, params))
    llm = graph_llm(tiny, max_model_len=64)
    got = llm.generate(prompts, params)
    assert summary(got) == want
    assert got[3].outputs[0].finish_reason == "length"
    assert len(got[3].prompt_token_ids) + len(got[3].outputs[0].token_ids) == 64
    assert llm.engine.num_pipelined_verify_steps > 3 and llm.engine.num_sync_steps > 6
    assert llm.engine.kv.usage == 0.0


def test_arrivals_aborts_and_sampling_free_every_block(tiny):  # noqa: F811
    """Requests arriving and aborted between steps while verify steps are in flight, greedy and
    unseeded sampling (which pipeline too): the greedy ones that finish give decoding's tokens,
    and every block and head state is freed."""
    llm = graph_llm(tiny)
    engine = llm.engine
    prompts = train_prompts()
    rng = random.Random(3)
    greedy: dict[str, tuple[list[int], int]] = {}
    live: list[str] = []
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()

    def step() -> None:
        for out in engine.step():  # deltas: each step's new tokens
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids if out.outputs else [])
            if out.finished:
                finished.add(out.request_id)
    for i in range(12):
        rid = f"r{i}"
        prompt, n = rng.choice(prompts), rng.randrange(4, 24)
        temperature = rng.choice([0.0, 0.0, 0.9])
        engine.add_request(rid, prompt, SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True))
        if temperature == 0.0:
            greedy[rid] = (prompt, n)
        live.append(rid)
        for _ in range(rng.randrange(1, 6)):
            step()
        if rng.random() < 0.3:
            victim = live.pop(rng.randrange(len(live)))
            engine.abort_request(victim)
            greedy.pop(victim, None)
    while engine.has_work():
        step()
    assert engine.num_pipelined_verify_steps > 10
    # every step replays one graph: greedy batches the greedy one, batches with a sampled request the sampled one
    runner = engine.runner
    assert runner.num_verify_graph_steps == engine.num_pipelined_verify_steps
    assert 0 < runner.num_sampled_verify_graph_steps < runner.num_verify_graph_steps
    done = [rid for rid in greedy if rid in finished]
    assert len(done) >= 4
    want = plain(tiny).generate([greedy[rid][0] for rid in done],
                                [SamplingParams(temperature=0.0, max_tokens=greedy[rid][1], ignore_eos=True) for rid in done])
    assert [tokens[rid] for rid in done] == [w.outputs[0].token_ids for w in want]
    assert engine._verify_in_flight is None and engine.kv.usage == 0.0 and not engine.runner.drafter.states


def test_unseeded_sampling_pipelined_draws_coupled_drafts(tiny):  # noqa: F811
    """Unseeded requests at temperature 1 pipeline their verify steps, and each launch draws the
    next step's noise ahead, with which the head draws their next drafts on the device (coupled):
    they are accepted far more often than the head's argmax, as on the synchronous path, and
    every block is freed."""
    prompts = train_prompts()[:4]
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    rate = {}
    for mode in ("greedy", "coupled"):
        llm = graph_llm(tiny, speculative_draft_sampling=mode)
        engine = llm.engine
        launch, drawn = engine.runner.launch_verify, []

        def counted(*args, **kwargs):
            out = launch(*args, **kwargs)
            drawn.append(out.next_noise is not None)
            return out
        engine.runner.launch_verify = counted
        outs = llm.generate(prompts, params)
        assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
        assert engine.num_pipelined_verify_steps > 10
        assert sum(drawn) == (len(drawn) if mode == "coupled" else 0)  # each launch drew the next step's noise
        assert engine.runner.num_sampled_verify_graph_steps == engine.num_pipelined_verify_steps  # one replay each
        stats = engine.spec_stats
        rate[mode] = stats.num_accepted_tokens / stats.num_draft_tokens
        while engine.has_work():  # a step launched past the last token is read
            engine.step()
        assert engine._verify_in_flight is None and engine.kv.usage == 0.0 and not engine.runner.drafter.states
    assert rate["coupled"] > 2 * rate["greedy"] + 0.05, rate


@pytest.mark.parametrize("mode,top_k", [("coupled", 0), ("greedy", 0), ("coupled", 20)])
def test_seeded_sampling_pipelined_equals_no_speculation(tiny, mode, top_k):  # noqa: F811
    """Seeded requests pipeline their verify steps: each launch hands the device their noise at
    the positions the step may start from, and the device picks it by the drafts the step in
    flight accepted (``SeededWindow``), inside the sampled verify graph, or (while a top-k request
    is in the batch) between the decode and draft graphs' replays. Their output is the non-speculative
    seeded output token for token, beside a greedy request, with n=2, a stop string and
    ``max_tokens`` inside an accepted run; the drafts accepted, position by position, are the
    synchronous steps' (coupled: drawn with the positions' noise); every block is freed."""
    prompts = train_prompts()[:4]
    params = [SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=11, max_tokens=13, n=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=24, top_k=top_k, ignore_eos=True)]
    want = plain(tiny).generate(prompts, params)
    text = want[3].outputs[0].text
    params[3] = SamplingParams(temperature=1.0, seed=3, max_tokens=24, top_k=top_k,
                               stop=[text[len(text) // 2:len(text) // 2 + 4]])
    want = summary(plain(tiny).generate(prompts, params))
    llm = graph_llm(tiny, speculative_draft_sampling=mode)
    engine = llm.engine
    sync, sync_accepted = synchronous(llm, prompts, params)
    assert sync == want
    assert summary(llm.generate(prompts, params)) == want
    assert engine.num_pipelined_verify_steps >= 10
    assert engine.runner.num_seeded_launches == engine.num_pipelined_verify_steps  # every batch had a seeded one
    sampled_graph_steps = engine.runner.num_sampled_verify_graph_steps
    if top_k:  # the top-k request's batches launch between the graphs; the others replay one graph
        assert 0 < sampled_graph_steps < engine.num_pipelined_verify_steps
    else:
        assert sampled_graph_steps == engine.num_pipelined_verify_steps
    # the same drafts accepted as the synchronous steps, position by position
    assert engine.spec_stats.accepted_per_pos == sync_accepted
    while engine.has_work():
        engine.step()
    assert engine._verify_in_flight is None and engine.kv.usage == 0.0 and not engine.runner.drafter.states


def test_sampled_verify_graphs_past_their_memory_bound_launch_eagerly_and_say_so(tiny, monkeypatch):  # noqa: F811
    """Where the sampled graphs' noise buffers would pass ``MAX_SAMPLED_BUFFER_BYTES``, none are
    captured: batches with sampled requests launch between the decode and draft graphs, said in
    /v1/backends and the gauge, and seeded output still equals decoding without speculation."""
    monkeypatch.setattr("cluster.engine.verify_step.MAX_SAMPLED_BUFFER_BYTES", 0)
    prompts = train_prompts()[:2]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    want = summary(plain(tiny).generate(prompts, params))
    llm = graph_llm(tiny)
    engine = llm.engine
    assert summary(llm.generate(prompts, params)) == want
    assert engine.num_pipelined_verify_steps >= 5 and engine.runner.num_sampled_verify_graph_steps == 0
    assert engine.metrics()["spec_verify_sampled_graphs_captured"] == 0.0
    row = [r for r in engine.backends() if r["component"] == "speculative_decoding"][0]
    assert "batches with sampled requests launch eagerly: the draw noise buffer would take" in row["reason"]
    while engine.has_work():
        engine.step()
    assert engine.kv.usage == 0.0


def test_a_failing_pipelined_step_hands_over_to_synchronous_steps(tiny, monkeypatch):  # noqa: F811
    """A pipelined verify step that raises (a bug, memory): the step in flight is read, verify
    steps run synchronously from then on, said in /v1/backends and the gauge, and every output
    still equals decoding without speculation."""
    prompts = train_prompts()[:3]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = summary(plain(tiny).generate(prompts, params))
    llm = graph_llm(tiny)
    engine = llm.engine
    real = engine.runner.launch_verify
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected verify failure")
        return real(*args)
    monkeypatch.setattr(engine.runner, "launch_verify", flaky)
    assert summary(llm.generate(prompts, params)) == want
    assert engine.num_pipelined_verify_steps == 3 and calls["n"] == 4 and engine.num_sync_steps > 3
    assert not engine._spec_pipelined and "injected verify failure" in engine.spec_pipeline_status
    row = [r for r in engine.backends() if r["component"] == "speculative_decoding"][0]
    assert "verify steps synchronous (a pipelined verify step failed" in row["reason"]
    assert engine.metrics()["spec_decode_pipelined"] == 0.0
    assert engine._verify_in_flight is None and engine.kv.usage == 0.0


def test_ngram_verify_steps_stay_synchronous(tiny):  # noqa: F811
    """The n-gram proposer reads the newest tokens on the host: its verify steps never pipeline,
    and /v1/backends says why."""
    engine = LLM(tiny[0], block_size=4, speculative_method="ngram", num_speculative_tokens=3).engine
    assert not engine._spec_pipelined and "proposes on the host" in engine.spec_pipeline_status
    row = [r for r in engine.backends() if r["component"] == "speculative_decoding"][0]
    assert "verify steps synchronous (speculative_method='ngram' proposes on the host)" in row["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pipelined_verify_steps_on_the_gpu_equal_graph_decode(tmp_path):
    """On a GPU (float32, Triton attention, real CUDA graphs): verify steps launched from the
    device, acceptance and the head's proposal with no host read between steps, give the tokens
    of pipelined graph decode without speculation, greedy, n samples and stops included, and
    seeded sampling likewise."""
    path = str(tmp_path / "llama")
    make_checkpoint(path, "llama", seed=11, max_position_embeddings=1024)
    settings = dict(block_size=16, dtype="float32", max_num_seqs=8, max_model_len=512, attention_backend="triton")
    base = LLM(path, **settings)
    prompts = train_prompts()[:6]
    outs = base.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    head = train_head(base, [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)], steps=40)
    head_path = save_head(head.cpu(), str(tmp_path / "head.safetensors"))
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, n=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[outs[3].outputs[0].token_ids[25]])]
    params = [params[i % len(params)] for i in range(len(prompts))]
    want = summary(base.generate(prompts, params))
    llm = LLM(path, speculative_method="draft_head", num_speculative_tokens=K, speculative_model=head_path, **settings)
    engine = llm.engine
    assert engine._spec_pipelined, engine.spec_pipeline_status
    assert summary(llm.generate(prompts, params)) == want
    assert engine.num_pipelined_verify_steps >= 10 and engine.spec_stats.num_accepted_tokens > 0
    assert engine.runner.verify_graph_status.captured, engine.runner.verify_graph_status.describe()
    assert engine.runner.num_verify_graph_steps == engine.num_pipelined_verify_steps
    assert engine.runner.drafter.num_eager_proposals == 0 and engine.runner.num_eager_steps <= 4
    engine.step()
    assert engine._verify_in_flight is None and engine.kv.usage == 0.0
    # seeded sampling pipelines too, its noise picked on the device by the accepted drafts
    seeded = [SamplingParams(temperature=1.0 if i % 2 else 0.7, seed=5 + i, max_tokens=40, ignore_eos=True)
              for i in range(len(prompts))]
    want = summary(base.generate(prompts, seeded))
    runner = engine.runner
    steps, launches = engine.num_pipelined_verify_steps, runner.num_seeded_launches
    graphed = runner.num_sampled_verify_graph_steps
    assert summary(llm.generate(prompts, seeded)) == want
    assert runner.num_seeded_launches - launches == engine.num_pipelined_verify_steps - steps >= 10
    # each of them one replay of the sampled verify graph (its draws and noise windows captured)
    assert runner.num_sampled_verify_graph_steps - graphed == engine.num_pipelined_verify_steps - steps
    while engine.has_work():
        engine.step()
    assert engine._verify_in_flight is None and engine.kv.usage == 0.0
