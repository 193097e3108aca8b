"""The model runner reads the SchedulerOutput and nothing else: every scheduled request's live
``Request`` is replaced by an object that raises on any access before the runner sees the step,
synchronous and pipelined, and the tokens are still those of an untouched engine (chunked
prefill, prefix hits, n samples drawing first tokens from one row, penalties, min_tokens,
logprobs, seeds)."""
from __future__ import annotations

import pytest

from cluster import LLM, SamplingParams
from cluster.engine.scheduler import SchedulerOutput
from tests.factories import make_checkpoint, mixed_prompts


class _Poison:
    def __getattr__(self, name: str):
        raise AssertionError(f"the runner read Request.{name}: it must read only the SchedulerOutput")


def _poisoned(fn):
    def run(sched: SchedulerOutput, *args):
        live = [s.request for s in sched.scheduled]
        for s in sched.scheduled:
            s.request = _Poison()  # type: ignore[assignment]
        try:
            return fn(sched, *args)
        finally:
            for s, r in zip(sched.scheduled, live):
                s.request = r
    return run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    make_checkpoint(path, "llama", seed=3)
    return path


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),  # decodes pipelined once alone
    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, seed=5, n=3),  # forks at the first token
    SamplingParams(temperature=0.7, max_tokens=9, seed=2, repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams(temperature=1.0, min_tokens=6, max_tokens=8, seed=4, logprobs=2),
]


def _summary(outputs):
    return [[(c.token_ids, c.finish_reason, [sorted(p) for p in (c.logprobs or [])]) for c in o.outputs]
            for o in outputs]


@pytest.mark.parametrize("pipelined", [False, True])
def test_runner_reads_only_the_scheduler_output(model_dir, pipelined):
    prompts = mixed_prompts(300, (5, 23, 40, 9), seed=2)
    prompts[3] = prompts[1][:20] + [7, 8]  # a prefix hit on prompt 1's blocks
    want_llm = LLM(model_dir, block_size=4, max_num_batched_tokens=16)
    want = _summary(want_llm.generate(prompts, PARAMS))

    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=16)
    runner = llm.engine.runner
    runner.execute = _poisoned(runner.execute)
    runner.launch = _poisoned(runner.launch)
    runner.can_launch = _poisoned(runner.can_launch)
    llm.engine._pipelined = pipelined
    got = _summary(llm.generate(prompts, PARAMS))
    assert got == want
    assert (llm.engine.num_pipelined_steps > 0) == pipelined
    assert llm.engine.num_sync_steps > 0
