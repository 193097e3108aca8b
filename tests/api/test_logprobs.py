"""Token texts and bytes for logprobs (byte-level tokens that split a character), ranks, and
impossible tokens (no -Infinity in JSON)."""
from __future__ import annotations

from cluster.api.logprobs import MIN_LOGPROB, TokenTexts, chat_logprobs, completion_logprobs
from cluster.common.outputs import Logprob


def test_bytes_of_tokens_that_split_a_character(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("é€ hello", add_special_tokens=False)
    raw = b"".join(bytes(texts.get(t)[1]) for t in ids)
    assert raw.decode("utf-8") == "é€ hello"
    eos = tokenizer.eos_token_ids[0]
    assert texts.get(eos) == ("<|im_end|>", list(b"<|im_end|>"))


def test_top_entries_follow_rank_and_clamp_infinities(tokenizer):
    texts = TokenTexts(tokenizer)
    a, b, c = 65, 66, 67
    position = {c: Logprob(float("-inf"), rank=9), a: Logprob(-0.5, rank=1), b: Logprob(-1.5, rank=2)}
    [entry] = chat_logprobs(texts, [c], [position], num_top=2)
    assert entry.logprob == MIN_LOGPROB and [t.logprob for t in entry.top_logprobs] == [-0.5, -1.5]
    out, end = completion_logprobs(texts, [c], [position], num_top=1, text_offset=7)
    assert out.text_offset == [7] and end == 7 + len(texts.text(c))
    assert out.top_logprobs == [{texts.text(a): -0.5, texts.text(c): MIN_LOGPROB}]
