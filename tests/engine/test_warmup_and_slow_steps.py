"""Start-up prefill warm-up (``ModelConfig.prefill_warmup``: a prompt of every power-of-two length
up to the step budget runs once, so no served step waits for a prefill kernel's autotuning) and
slow-step accounting (``SchedulerConfig.slow_step_s``: counted, the slowest step as a gauge, a
rate-limited warning with the step's shape). The warm-up runs on a GPU; here it is forced on CPU,
where it must leave the KV cache and every output exactly as it found them."""
from __future__ import annotations

import logging

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.common.errors import UnsupportedSettingError
from cluster.config import parse_cluster_args
from cluster.engine import step_loop
from cluster.engine.engine import warmup_lengths
from tests.deepseek_factories import make_v4_checkpoint
from tests.factories import generate_disaggregated, local_pd_workers, make_checkpoint, mixed_prompts


def test_warmup_lengths_cover_every_power_of_two_bucket_up_to_the_budget():
    assert warmup_lengths(8192) == [1 << i for i in range(14)]
    assert warmup_lengths(3000) == [1 << i for i in range(12)] + [3000]  # 3000 fills the 4096 bucket
    assert warmup_lengths(1) == [1] and warmup_lengths(2) == [1, 2] and warmup_lengths(0) == []


def _warmup_keeps_outputs(path: str, vocab: int, **settings) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = mixed_prompts(vocab, (5, 40, 97, 18), seed=3)
    plain = LLM(path, **settings)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    warmed = LLM(path, **settings)
    engine = warmed.engine
    assert engine.prefill_warmup_lengths == [] and engine.startup_timings.get("prefill_warmup_s") is None  # CPU
    free = engine.kv.num_free_blocks()
    engine._warm_prefill(force=True)
    budget = min(engine.scheduler_config.max_num_batched_tokens, engine.scheduler_config.max_model_len)
    assert engine.prefill_warmup_lengths == warmup_lengths(budget)
    assert engine.startup_timings["prefill_warmup_s"] > 0
    assert engine.kv.num_free_blocks() == free and not engine.kv.tables  # every block back, no owner left
    [row] = [r for r in engine.backends() if r["component"] == "prefill_warmup"]
    assert row["impl"] == "warmed" and f"prompts of 1..{budget} tokens" in row["reason"]
    # the warm-up's KV was written into blocks that requests now reuse, and cached nothing
    assert [o.outputs[0].token_ids for o in warmed.generate(prompts, params)] == want
    assert engine.scheduler.prefix_cache_hit_rate == plain.engine.scheduler.prefix_cache_hit_rate


def test_a_forced_warmup_frees_its_blocks_and_changes_no_output(tmp_path):
    path = str(tmp_path / "llama")
    make_checkpoint(path)
    _warmup_keeps_outputs(path, 240, max_num_batched_tokens=128, max_model_len=256, block_size=16)


def test_the_warmup_of_a_model_with_window_compressed_and_state_groups(tmp_path):
    """DeepSeek-V4 (sliding, CSA and HCA layers: six KV groups, compressor states): the warm-up
    allocates and frees in every group and leaves the greedy tokens unchanged."""
    path = str(tmp_path / "v4")
    make_v4_checkpoint(path, "csa_hca")
    _warmup_keeps_outputs(path, 500, max_num_batched_tokens=256, max_model_len=512, block_size=16,
                          max_num_seqs=8)


def test_a_kv_cache_smaller_than_the_budget_warms_what_fits(tmp_path):
    path = str(tmp_path / "llama")
    make_checkpoint(path)
    llm = LLM(path, max_num_batched_tokens=512, max_model_len=512, block_size=16, num_kv_blocks=9)  # 8 usable: 128
    llm.engine._warm_prefill(force=True)
    assert llm.engine.prefill_warmup_lengths == [1, 2, 4, 8, 16, 32, 64, 128]
    assert llm.engine.kv.num_free_blocks() == [8]


def test_the_warmup_says_why_it_did_not_run(tmp_path):
    path = str(tmp_path / "llama")
    make_checkpoint(path)
    cpu = LLM(path, max_num_batched_tokens=64, max_model_len=128)
    off = LLM(path, max_num_batched_tokens=64, max_model_len=128, prefill_warmup=False)
    for llm, impl, words in ((cpu, "off", "not needed on cpu"), (off, "off", "prefill_warmup=false")):
        [row] = [r for r in llm.engine.backends() if r["component"] == "prefill_warmup"]
        assert row["impl"] == impl and words in row["reason"], row
    config = parse_cluster_args({"prefill_warmup": "false", "slow_step_s": "0.25"}, use_env=False)
    assert config.model.prefill_warmup is False and config.scheduler.slow_step_s == 0.25
    with pytest.raises(UnsupportedSettingError, match="slow_step_s"):
        parse_cluster_args({"slow_step_s": "-1"}, use_env=False)


def test_slow_steps_are_counted_and_said_at_most_once_a_period(tmp_path, caplog, monkeypatch):
    path = str(tmp_path / "llama")
    make_checkpoint(path)
    llm = LLM(path, max_num_batched_tokens=64, max_model_len=128, slow_step_s=1e-9)  # every step is slow
    engine = llm.engine
    assert engine.slow_step_s == 1e-9
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="cluster.engine.step_loop"):
        llm.generate(mixed_prompts(240, (90, 7), seed=2), params)  # 90 tokens: two chunks of the 64 budget
    steps = engine.num_slow_steps
    assert steps >= 7 and engine.counters()["slow_steps_total"] == steps
    assert engine.metrics()["slowest_step_seconds"] == engine.slowest_step_s > 0
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow step")]
    assert len(warnings) == 1  # the rest within the period go unsaid
    # the first step: the first 64 of the 90-token prompt (the budget), the 7-token one waiting
    assert "for 64 tokens of 1 requests (1 prompt chunks, the longest 64 tokens; contexts up to 64 tokens)" in warnings[0]
    assert warnings[0].endswith("1 slow steps since start-up")
    monkeypatch.setattr(step_loop, "SLOW_STEP_LOG_PERIOD_S", 0.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cluster.engine.step_loop"):
        llm.generate(mixed_prompts(240, (5,), seed=4), params)
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow step")]
    assert len(warnings) == engine.num_slow_steps - steps  # every one said now
    assert f"{steps - 1} not logged since the last warning" in warnings[0]


def test_a_cpu_counts_no_slow_steps_by_default(tmp_path):
    path = str(tmp_path / "llama")
    make_checkpoint(path)
    llm = LLM(path, max_num_batched_tokens=64, max_model_len=128)
    assert llm.engine.slow_step_s == 0.0
    llm.generate(mixed_prompts(240, (30,), seed=2), SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm.engine.num_slow_steps == 0 and llm.engine.slowest_step_s > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_start_up_tunes_every_prefill_bucket_so_serving_tunes_none(tmp_path):
    """On a GPU the warm-up runs by default and leaves the prefill attention kernel's autotuner
    nothing to tune for any prompt (whole or chunked, alone or batched, beside decoding requests)
    up to the budget: no served step pays for a benchmark of its configs. Its outputs equal a
    replica's without the warm-up."""
    from kernels.triton_attention_prefill import _prefill_kernel
    path = str(tmp_path / "llama")
    make_checkpoint(path, max_position_embeddings=1024)
    common = dict(dtype="bfloat16", max_num_batched_tokens=512, max_model_len=1024, max_num_seqs=8)
    llm = LLM(path, **common)
    engine = llm.engine
    assert engine.prefill_warmup_lengths == warmup_lengths(512) and engine.slow_step_s == 0.5
    [row] = [r for r in engine.backends() if r["component"] == "prefill_warmup"]
    assert row["impl"] == "warmed" and "prompts of 1..512 tokens (10 lengths)" in row["reason"]
    assert engine.startup_timings["prefill_warmup_s"] > 0
    tuned = dict(_prefill_kernel.cache)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = mixed_prompts(240, (3, 17, 100, 300, 511, 900, 45, 250), seed=5)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert dict(_prefill_kernel.cache) == tuned  # nothing tuned while serving
    assert engine.num_step_compiles == 0, compiled(engine)  # nor compiled
    plain = LLM(path, prefill_warmup=False, **common)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == got


def compiled(engine) -> str:
    from cluster.engine.stalls import Stalls
    return f"served steps compiled: {Stalls(list(engine.step_compilations)).describe()}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_prefill_replica_compiles_nothing_while_serving(tmp_path):
    """A prefill worker (no decode graphs: only its warm-up compiles) packs concurrent prompts of
    every length into steps of several prompts, odd token counts and block tables of any width,
    samples several first tokens a step: none of it compiles a kernel after start-up, on either
    side of the hand-over."""
    path = str(tmp_path / "llama")
    make_checkpoint(path, max_position_embeddings=1024)
    settings = dict(model=path, dtype="bfloat16", max_num_batched_tokens=512, max_model_len=1024, max_num_seqs=8,
                    kv_cache_memory_bytes=1 << 30)
    lengths = (3, 17, 100, 300, 511, 900, 45, 250, 33, 129, 640, 77, 1, 2, 16, 31)
    prompts = mixed_prompts(240, lengths, seed=6)
    with local_pd_workers(settings) as (prefill, decode):
        assert prefill.engine.engine.prefill_warmup_lengths == warmup_lengths(512)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        first = generate_disaggregated(decode, prompts, params)
        sampled = generate_disaggregated(decode, prompts[::-1], SamplingParams(temperature=0.8, top_p=0.9, seed=1,
                                                                               max_tokens=4, ignore_eos=True))
        assert all(len(t) == 6 for t in first) and all(len(t) == 4 for t in sampled)
        for engine in (prefill.engine.engine, decode.engine.engine):
            assert engine.num_step_compiles == 0, compiled(engine)
            assert engine.counters()["step_kernel_compiles_total"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_deepseek_v4_compiles_nothing_while_serving(tmp_path):
    """DeepSeek-V4 (sliding, CSA and HCA layers; MoE) colocated: prompts alone and together,
    chunked beside decoding requests, compile nothing after start-up."""
    path = str(tmp_path / "v4")
    make_v4_checkpoint(path, "csa_hca")
    llm = LLM(path, dtype="bfloat16", max_num_seqs=8, max_model_len=512, max_num_batched_tokens=256)
    engine = llm.engine
    assert engine.prefill_warmup_lengths == warmup_lengths(256)
    prompts = mixed_prompts(500, (3, 17, 100, 300, 45, 250, 33, 129, 1, 2, 16, 31), seed=7)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert engine.num_step_compiles == 0, compiled(engine)


def _fire_compile_hooks(name: str) -> None:
    """What Triton calls around a compilation (``knobs.runtime``'s two JIT hooks), as a GPU would."""
    from types import SimpleNamespace

    from triton import knobs
    fn = SimpleNamespace(name=name)
    assert not knobs.runtime.jit_cache_hook(key="k", repr=name, fn=fn, compile={}, is_manual_warmup=False,
                                            already_compiled=False)  # falsy: Triton goes on to compile
    knobs.runtime.jit_post_compile_hook(key="k", repr=name, fn=fn, compile={}, is_manual_warmup=False,
                                        already_compiled=False)


def test_a_kernel_compiled_inside_a_served_step_is_counted_named_and_said(tmp_path, caplog, monkeypatch):
    """A Triton compilation inside a step (a shape the warm-up missed) is counted
    (``step_kernel_compiles_total``, its seconds), kept by name and warned of with the step's
    shape; a slow step says what held it. Compilations at start-up are not counted as served."""
    from cluster.engine import stalls
    path = str(tmp_path / "llama")
    make_checkpoint(path)
    llm = LLM(path, max_num_batched_tokens=64, max_model_len=128, slow_step_s=1e-9)
    engine = llm.engine
    assert engine.num_step_compiles == 0 and engine.startup_stalls.compilations == []
    run = engine.runner.execute
    calls = []

    def compiling(sched):
        if not calls:  # the first step compiles two kernels, as a new specialisation would
            _fire_compile_hooks("_prefill_kernel")
            _fire_compile_hooks("_skinny_linear_kernel")
        calls.append(1)
        return run(sched)

    monkeypatch.setattr(engine.runner, "execute", compiling)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="cluster.engine.step_loop"):
        llm.generate(mixed_prompts(240, (20,), seed=1), params)
    assert engine.num_step_compiles == 2 and engine.counters()["step_kernel_compiles_total"] == 2
    assert [c.kernel for c in engine.step_compilations] == ["_prefill_kernel", "_skinny_linear_kernel"]
    assert engine.counters()["step_kernel_compile_seconds_total"] >= 0
    said = [r.getMessage() for r in caplog.records]
    [warning] = [m for m in said if m.startswith("a served step compiled Triton kernels")]
    assert "compiling 2 Triton kernels (_prefill_kernel, _skinny_linear_kernel)" in warning
    assert "for 20 tokens of 1 requests" in warning and "2 compilations inside steps since start-up" in warning
    [slow] = [m for m in said if m.startswith("slow step")]
    assert "; in it: " in slow and "compiling 2 Triton kernels" in slow
    # a second engine's compilations are its own steps'
    assert stalls.StallWatch().since(stalls.StallWatch().mark()).compilations == []


def test_garbage_collection_inside_steps_is_timed_and_a_replica_freezes_its_start_up_heap(tmp_path, monkeypatch):
    import gc
    from cluster.engine.stalls import freeze_heap
    path = str(tmp_path / "llama")
    make_checkpoint(path)
    llm = LLM(path, max_num_batched_tokens=64, max_model_len=128)
    engine = llm.engine
    run = engine.runner.execute

    def collecting(sched):
        gc.collect()
        return run(sched)

    monkeypatch.setattr(engine.runner, "execute", collecting)
    llm.generate(mixed_prompts(240, (9,), seed=1), SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.counters()["step_gc_seconds_total"] > 0 and engine.stall_watch.slowest_gc_seconds > 0
    try:
        assert freeze_heap() > 1000 and gc.get_freeze_count() > 1000  # the model, torch's modules...
    finally:
        gc.unfreeze()
