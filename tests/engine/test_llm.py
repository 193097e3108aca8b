"""The offline API end to end on a small random Llama with a real BPE tokenizer: text in and out,
stop conditions, n samples, seeds, logprobs, chat, prefix caching, deadlines."""
from __future__ import annotations

import pytest

from cluster import LLM, SamplingParams
from tests.factories import make_checkpoint, mixed_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    make_checkpoint(path, "llama")
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, block_size=4, max_num_batched_tokens=64)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_text_prompt_and_detokenized_output(llm):
    out = llm.generate("the quick brown fox", GREEDY)[0]
    tok = llm.get_tokenizer()
    assert out.prompt == "the quick brown fox"
    assert out.prompt_token_ids == tok.encode("the quick brown fox")
    completion = out.outputs[0]
    assert len(completion.token_ids) == 24
    assert completion.text == tok.decode(completion.token_ids)


def test_stop_string_is_never_emitted(llm):
    base = llm.generate("hello world", GREEDY)[0].outputs[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    out = llm.generate("hello world", GREEDY.replace(stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and base.text.startswith(out.text)
    assert out.text == base.text[: base.text.find(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate([5, 6, 7, 8], GREEDY)[0].outputs[0].token_ids
    stop_at = base[4]
    out = llm.generate([5, 6, 7, 8], GREEDY.replace(stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids[-1] == stop_at and len(out.token_ids) == base.index(stop_at) + 1
    # min_tokens forbids the stop token until that many tokens exist
    late = llm.generate([5, 6, 7, 8], GREEDY.replace(stop_token_ids=[stop_at], min_tokens=10))[0].outputs[0]
    assert stop_at not in late.token_ids[:9] and len(late.token_ids) >= 10


def test_n_samples_and_seeds(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    first = llm.generate([10, 11, 12], params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # samples differ
    # same seed, different batch company: same tokens
    crowd = llm.generate([[10, 11, 12], [40, 41], [7] * 20],
                         [params, SamplingParams(temperature=1.0, max_tokens=5), GREEDY])[0]
    assert [c.token_ids for c in crowd.outputs] == [c.token_ids for c in first.outputs]


def test_held_samples_end_with_their_request(model_dir):
    """An abort (or deadline) while sample 0 still computes the prompt ends the held samples too."""
    llm = LLM(model_dir, block_size=16, max_model_len=512)
    engine = llm.engine
    engine.add_request("r", mixed_prompts(256, (150,), seed=4)[0],
                       SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    group = engine.groups["r"]
    assert [s.request_id for s in group.held] == ["r#1", "r#2"]
    engine.abort_request("r")
    assert all(s.status.finished for s in group.samples) and not engine.groups
    assert engine.kv.usage == 0.0


def test_logprobs(llm):
    out = llm.generate([3, 4, 5], GREEDY.replace(logprobs=4, max_tokens=5))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token].rank == 1  # greedy picks the most likely
        assert len(entry) == 4 and all(lp.logprob <= 0 for lp in entry.values())


def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hello world"}]
    out = llm.chat(messages, GREEDY.replace(max_tokens=4))[0]
    expected = tok.encode("<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)
    assert out.prompt_token_ids == expected


def test_prefix_caching_reuses_blocks_and_keeps_tokens(model_dir):
    prefix = mixed_prompts(300, (40,), seed=5)[0]
    prompts = [prefix + [7, 8, 9], prefix + [20, 21]]
    cached = LLM(model_dir, block_size=4)
    first = cached.generate(prompts[:1], GREEDY)[0]
    second = cached.generate(prompts[1:], GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 40
    plain = LLM(model_dir, block_size=4, enable_prefix_caching=False)
    expected = plain.generate(prompts[1:], GREEDY)[0]
    assert expected.num_cached_tokens == 0
    assert second.outputs[0].token_ids == expected.outputs[0].token_ids
    assert cached.engine.scheduler.prefix_cache_hit_rate > 0.4


def test_generation_stops_at_max_model_len(model_dir):
    llm = LLM(model_dir, block_size=4, max_model_len=32)
    out = llm.generate([1] * 20, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 12


def test_deadline_aborts_the_request_and_frees_blocks(llm):
    out = llm.generate([5] * 10, SamplingParams(max_tokens=10_000, ignore_eos=True, deadline_s=0.05))[0]
    assert out.outputs[0].finish_reason == "abort" and out.error == "deadline exceeded"
    assert llm.engine.kv.usage == 0.0
