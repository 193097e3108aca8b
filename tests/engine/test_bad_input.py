"""Bad input gets a typed, clear exception and leaves the engine serving other requests."""
from __future__ import annotations

import pytest

from cluster import LLM, SamplingParams
from cluster.common.errors import InvalidRequestError
from tests.factories import make_checkpoint, mixed_prompts


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    make_checkpoint(path, "llama")
    return LLM(path, block_size=4, max_model_len=64)


GOOD = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("prompt, param, words", [
    ("", "prompt", "empty"),
    ([], "prompt", "empty"),
    ([1] * 64, "prompt", "max_model_len"),
    ([1, 2, 320], "prompt", "outside the vocabulary"),
    ([1, -1], "prompt", "outside the vocabulary"),
])
def test_bad_prompts(llm, prompt, param, words):
    with pytest.raises(InvalidRequestError, match=words) as info:
        llm.generate([[5, 6, 7], prompt], GOOD)
    assert info.value.param == param
    assert not llm.engine.has_unfinished_requests()  # the good prompt was not left behind
    assert llm.generate([5, 6, 7], GOOD)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"logprobs": 100}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_bad_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in str(info.value)


def test_engine_keeps_serving_after_errors(llm):
    for bad in ("", [10_000]):
        with pytest.raises(InvalidRequestError):
            llm.generate(bad, GOOD)
    outs = llm.generate([[5, 6], [7, 8, 9]], GOOD)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert llm.engine.kv.usage == 0.0


@pytest.mark.timeout(60)
def test_a_request_the_kv_cache_can_never_hold_ends_with_an_error(tmp_path):
    """A request that outgrows the whole pool (preempted, then too long for an empty one) ends
    with an error output. The scheduler failed it without telling the engine, so the request
    (and ``generate``) waited for ever."""
    path = str(tmp_path / "llama")
    make_checkpoint(path, "llama")
    llm = LLM(path, block_size=4, num_kv_blocks=6, max_model_len=64, enable_prefix_caching=False)
    out = llm.generate(mixed_prompts(300, (8,), seed=1), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert out[0].outputs[0].finish_reason == "error" and "too small" in out[0].error
    assert llm.engine.kv.usage == 0.0 and not llm.engine.has_unfinished_requests()
