"""Prompt chunks capped per step: ``long_prefill_token_threshold`` (vLLM's meaning) and chunks
sized from measured steps to a step-time target (``prefill_step_target_s``, which a decode
replica sets from its ITL target so a prompt it prefills itself does not stall its decoding
requests). The cap changes which tokens a step carries, never the output."""
from __future__ import annotations

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.common.errors import UnsupportedSettingError
from cluster.config import ClusterConfig, SchedulerConfig, TransferConfig, parse_cluster_args
from cluster.engine.scheduler import ChunkSizer
from tests.engine.test_scheduler import make_scheduler, req, run_step
from tests.factories import make_checkpoint, mixed_prompts


def test_the_threshold_caps_prompt_chunks_and_leaves_decode_rows_alone():
    s = make_scheduler(budget=16)
    s.config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256,
                               long_prefill_token_threshold=5)
    a = req("a", 3)
    s.add_request(a)
    run_step(s)  # a's prompt (3 <= 5) in one chunk, its first token sampled
    b, c = req("b", 12, first=40), req("c", 7, first=80)
    s.add_request(b)
    s.add_request(c)
    steps = [[(x.request.request_id, x.num_new_tokens) for x in run_step(s).scheduled] for _ in range(3)]
    # every step: a decodes, each prompt takes at most 5 tokens (not the 16 of the budget)
    assert steps == [[("a", 1), ("b", 5), ("c", 5)], [("a", 1), ("b", 5), ("c", 2)], [("a", 1), ("b", 2), ("c", 1)]]
    assert b.num_output_tokens == 1 and c.num_output_tokens == 2


def test_the_measured_cap_takes_the_lower_of_the_two():
    s = make_scheduler(budget=32)
    s.config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256,
                               long_prefill_token_threshold=12)
    s.chunk_sizer = ChunkSizer(0.05, budget=32)
    s.chunk_sizer.cap = 6  # as if measured
    r = req("a", 20)
    s.add_request(r)
    assert [run_step(s).scheduled[0].num_new_tokens for _ in range(4)] == [6, 6, 6, 2]
    s.chunk_sizer.cap = 40
    assert s.chunk_cap() == 12


def test_the_sizer_converges_to_the_tokens_that_fill_the_target():
    a, b, target = 0.010, 0.0002, 0.080  # a step: 10 ms fixed + 0.2 ms a prompt token
    exact = (target - a) / b  # 350 tokens
    sizer = ChunkSizer(target, budget=4096, initial=64)
    caps = []
    for _ in range(30):
        p = sizer.cap
        caps.append(sizer.observe(p, True, a + b * p))
    assert caps[:3] == [128, 256, 334]  # doubling at most, then the suggestion
    assert all(x <= exact + 1 for x in caps)  # within the target all the way up
    assert abs(caps[-1] - exact) <= 2


@pytest.mark.parametrize("fixed_share", [0.25, 0.5, 0.75])
def test_noisy_steps_do_not_hold_the_sizer_below_the_target(fixed_share):
    """Steps whose time scatters (here +-20%, one in twenty twice as long) about ``a + b p``, with
    the decode part ``a`` a quarter to three quarters of the target: the sizer's average cap stays
    near the tokens that fill the target (0.98 / 0.96 / 0.90 of them: the suggestion's ``1/t``
    favours short steps, which offsets most of the spikes' cuts), so noise does not hold a
    replica's prefill rate far below the target's."""
    import random
    target, b = 0.080, 0.0001
    a = fixed_share * target
    exact = (target - a) / b
    rnd = random.Random(7)
    sizer = ChunkSizer(target, budget=16384, initial=64)
    caps, times = [], []
    for _ in range(4000):
        p = sizer.cap
        t = (a + b * p) * (1 + rnd.uniform(-0.2, 0.2)) * (2.0 if rnd.random() < 0.05 else 1.0)
        sizer.observe(p, True, t)
        caps.append(p)
        times.append(t)
    mean_cap = sum(caps[200:]) / len(caps[200:])
    assert 0.85 * exact <= mean_cap <= 1.15 * exact, (mean_cap, exact)
    mean_t = sum(times[200:]) / len(times[200:])
    assert mean_t <= 1.15 * target  # the spikes, not a cap that drifts up


def test_the_sizer_shrinks_at_once_on_an_overrun_and_ignores_uninformative_steps():
    sizer = ChunkSizer(0.1, budget=2048, initial=1024)
    assert sizer.observe(1024, True, 0.4) == 256  # 4x over: 4x fewer tokens at once
    assert sizer.observe(30, False, 0.02) == 256  # a short prompt not bounded by the cap: no lesson
    assert sizer.observe(30, False, 0.3) == 16  # but any step over the target shrinks it, to the floor
    assert sizer.observe(16, True, 0.001) == 32  # growth at most 2x a step
    assert ChunkSizer(0.1, budget=8).cap == 8  # never above the token budget


def _prompts_beside_a_decode(per_step: bool, prompts: int = 4, steps: int = 16) -> tuple[list[float], list[list]]:
    """A request decoding while ``prompts`` long prompts arrive at once; a step takes 10 ms plus
    0.2 ms a prompt token; an 80 ms target. The step times and each step's (request, tokens)."""
    from cluster.engine.step_loop import StepLoop
    s = make_scheduler(num_blocks=2048, budget=4096, max_num_seqs=16)
    s.config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=4096,
                               prefill_step_target_s=0.08, sized_chunks_per_step=per_step)
    s.chunk_sizer = ChunkSizer(0.08, budget=4096, initial=256)
    s.add_request(req("a", 3))
    run_step(s)
    for i in range(prompts):
        s.add_request(req(f"p{i}", 1500, first=10 + i))
    times, rows = [], []
    for _ in range(steps):
        out = run_step(s)
        seconds = 0.010 + 0.0002 * sum(x.num_new_tokens for x in out.scheduled if x.num_new_tokens > 1)
        StepLoop._size_chunks(s.chunk_sizer, out, seconds, per_step)
        times.append(seconds)
        rows.append([(x.request.request_id, x.num_new_tokens) for x in out.scheduled])
    return times, rows


def test_four_prompts_at_once_each_capped_settle_at_four_times_the_target():
    """The default (each prompt's chunk capped): the sizer learns from the step's total but caps
    every prompt, so four prompts prefilling together settle at steps about four times the target
    (the reason for ``sized_chunks_per_step``)."""
    times, rows = _prompts_beside_a_decode(per_step=False, steps=4)
    assert all(len(r) == 5 for r in rows)  # the decode and all four prompts every step
    assert all(t > 3.5 * 0.08 for t in times[1:])  # settled: 4 x ~387 tokens a step, 0.32 s


def test_the_per_step_cap_keeps_steps_at_the_target_whatever_the_prompts_waiting():
    """``sized_chunks_per_step``: the learned cap bounds the step's prompt tokens together, so the
    step stays at the 80 ms target with four prompts waiting; the prompts go in arrival order (the
    first one's first token comes after its own chunks, not after all four prompts'), the
    decoding request gets its token every step, and a prompt waits only while the step is full."""
    times, rows = _prompts_beside_a_decode(per_step=True, steps=24)
    assert all(r[0] == ("a", 1) for r in rows)
    assert max(times) <= 0.08 + 1e-9 and min(times[3:15]) > 0.075  # converged to the target, prompts left
    order = [rid for r in rows for rid, n in r[1:] if n > 1]
    assert order == sorted(order)  # p0's chunks, then p1's, ...: one prompt after another
    firsts = [next(i for i, r in enumerate(rows) if (f"p{k}", 1) in r) for k in range(2)]
    assert firsts[0] < firsts[1] and firsts[0] <= 6  # p0's first token after about 1500 / 350 steps
    # the threshold still caps each prompt beside the per-step bound
    s = make_scheduler(num_blocks=256, budget=64, max_num_seqs=8)
    s.config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                               long_prefill_token_threshold=5, prefill_step_target_s=0.05,
                               sized_chunks_per_step=True)
    s.chunk_sizer = ChunkSizer(0.05, budget=64)
    s.chunk_sizer.cap = 12  # as if measured
    for rid in ("x", "y", "z"):
        s.add_request(req(rid, 20))
    assert [(x.request.request_id, x.num_new_tokens) for x in run_step(s).scheduled] == [("x", 5), ("y", 5), ("z", 2)]


def test_settings_and_the_decode_role_default():
    config = parse_cluster_args({"long_prefill_token_threshold": "256", "local_prefill_itl_share": "0.5",
                                 "target_itl_s": "0.05"}, use_env=False)
    assert config.scheduler.long_prefill_token_threshold == 256
    assert config.transfer.local_prefill_itl_share == 0.5
    assert TransferConfig().local_prefill_itl_share == 0.8 and SchedulerConfig().prefill_step_target_s == 0
    assert not parse_cluster_args({"sized_chunks_per_step": "false"}, use_env=False).scheduler.sized_chunks_per_step
    assert SchedulerConfig().sized_chunks_per_step  # the default: the cap bounds the step's prompt tokens
    with pytest.raises(UnsupportedSettingError, match="local_prefill_itl_share"):
        TransferConfig(local_prefill_itl_share=1.5)
    with pytest.raises(UnsupportedSettingError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    assert isinstance(config, ClusterConfig)


def _engine_steps(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], list[dict]]:
    engine = llm.engine
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps: list[dict[str, int]] = []

    def step() -> None:
        for out in engine.step():  # deltas
            for sample in out.outputs:
                outputs[out.request_id].extend(sample.token_ids)
        steps.append({rid: n for rid, _, n in engine.last_step})

    engine.add_request("r0", prompts[0], params)
    while not outputs["r0"]:  # r0 decodes before the others arrive
        step()
    for i, p in enumerate(prompts[1:], 1):
        engine.add_request(f"r{i}", p, params)
    while engine.has_work():
        step()
    return [outputs[f"r{i}"] for i in range(len(prompts))], steps


def test_a_long_prompt_beside_a_decoding_request_is_chunked_to_the_target_without_changing_output():
    """The embedded default (its quantized prompt rows give one answer however a prompt is
    chunked): a request decoding while a long prompt arrives keeps getting a token every step,
    the prompt's chunks follow the sizer's cap, and the prompt's output equals the uncapped
    engine's. (The decoding request's own tokens are not compared: a decode row that shares a
    step with prompt rows takes the prompt rows' kernel on this path, so its numbers depend on
    which steps it shared, capped or not: tests/models/test_cpu_quant.py.)"""
    long_prompt = " ".join(f"item {i} is a line of the inventory;" for i in range(60))
    prompts, params = ["Count from one to twenty.", long_prompt], SamplingParams(temperature=0.0, max_tokens=24,
                                                                                  ignore_eos=True)
    want, plain_steps = _engine_steps(LLM("smollm2", max_num_batched_tokens=1024, enable_prefix_caching=False),
                                      prompts, params)
    assert max(s.get("r1", 0) for s in plain_steps) > 64  # uncapped, the prompt takes big chunks
    capped = LLM("smollm2", max_num_batched_tokens=1024, enable_prefix_caching=False, prefill_step_target_s=0.01)
    got, steps = _engine_steps(capped, prompts, params)
    assert got[1] == want[1] and len(got[0]) == len(want[0]) == 24
    cap_seen = capped.engine.scheduler.chunk_sizer.cap
    assert cap_seen is not None and cap_seen < 256  # a 10 ms target on a CPU: small chunks
    prompt_steps = [s for s in steps if s.get("r1", 0) > 1]
    assert len(prompt_steps) >= 3 and all(s["r1"] <= 256 for s in prompt_steps)
    last_r0 = max(i for i, s in enumerate(steps) if "r0" in s)
    first_r1 = min(i for i, s in enumerate(steps) if "r1" in s)
    assert last_r0 > first_r1 + 3  # they shared steps
    assert all("r0" in s for s in steps[first_r1:last_r0 + 1])  # r0 got its token in every one


def test_per_step_sized_chunks_in_the_engine_keep_outputs_and_the_step_bound():
    """The real engine with ``sized_chunks_per_step``: two long prompts arrive at once beside a
    decoding request; no step carries more prompt tokens than the cap it had learned by then, the
    decoding request gets a token every step, and the prompts' outputs equal the uncapped engine's."""
    long_a = " ".join(f"item {i} is a line of the inventory;" for i in range(20))
    long_b = " ".join(f"row {i} lists a part number;" for i in range(20))
    prompts = ["Count from one to twenty.", long_a, long_b]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want, _ = _engine_steps(LLM("smollm2", max_num_batched_tokens=1024, enable_prefix_caching=False), prompts, params)
    llm = LLM("smollm2", max_num_batched_tokens=1024, enable_prefix_caching=False, prefill_step_target_s=0.02,
              sized_chunks_per_step=True)
    caps: list[int] = []
    engine_step = llm.engine.step

    def step():  # the cap each step is scheduled under
        caps.append(llm.engine.scheduler.chunk_sizer.cap)
        return engine_step()
    llm.engine.step = step
    got, steps = _engine_steps(llm, prompts, params)
    assert got[1:] == want[1:] and len(got[0]) == 24
    shared = [(s, cap) for s, cap in zip(steps, caps) if s.get("r1", 0) > 1 or s.get("r2", 0) > 1]
    assert len(shared) >= 3
    assert all(sum(n for rid, n in s.items() if rid != "r0" and n > 1) <= cap for s, cap in shared)
    first_r1 = min(i for i, s in enumerate(steps) if "r1" in s)
    last_r0 = max(i for i, s in enumerate(steps) if "r0" in s)
    assert all("r0" in s for s in steps[first_r1:last_r0 + 1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("per_step", [False, True], ids=["per-prompt-cap", "sized_chunks_per_step"])
def test_sized_chunks_on_the_gpu_beside_graphed_pipelined_decodes(tmp_path, per_step):
    """A GPU decode replica prefilling locally, as served (CUDA graphs, pipelined steps): three
    long prompts arrive at once beside a decoding request under a step-time target small enough
    to cap every chunk. The prompts' outputs equal the uncapped eager engine's; the decoding
    request gets all its tokens; with ``sized_chunks_per_step`` no step schedules more prompt
    tokens than the cap it was scheduled under (per prompt otherwise)."""
    path = str(tmp_path / "llama")
    make_checkpoint(path, "llama", max_position_embeddings=2048)
    prompts = mixed_prompts(300, (9, 700, 650, 600), seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(block_size=16, dtype="float32", attention_backend="triton", max_num_seqs=8,
                  max_num_batched_tokens=2048, enable_prefix_caching=False)
    want, _ = _engine_steps(LLM(path, enforce_eager=True, **common), prompts, params)
    llm = LLM(path, prefill_step_target_s=0.002, sized_chunks_per_step=per_step, **common)
    assert llm.engine.runner.graphs is not None
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    seen: list[tuple[int, list[int]]] = []  # (the step's cap, its prompt chunks)

    def traced():
        cap = scheduler.chunk_sizer.cap
        out = schedule()
        seen.append((cap, [s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1]))
        return out
    scheduler.schedule = traced
    got, steps = _engine_steps(llm, prompts, params)
    assert got[1:] == want[1:] and len(got[0]) == 24
    chunked = [(cap, chunks) for cap, chunks in seen if chunks]
    assert len(chunked) >= 3  # uncapped, the three prompts (1950 tokens) would take one step
    if per_step:
        assert all(sum(chunks) <= cap for cap, chunks in chunked)
    else:
        assert all(max(chunks) <= cap for cap, chunks in chunked)
    first_r1 = min(i for i, s in enumerate(steps) if "r1" in s)
    assert any("r0" in s for s in steps[first_r1:])  # r0 kept decoding while the prompts were chunked
