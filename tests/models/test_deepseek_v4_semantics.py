"""DeepSeek-V4's compressed attention over long prompts, pinned down. The rule (DeepSeek's
reference inference code, transformers, and this engine, in prefill as in decode): a query at
position t attends compressed entry e, and the lightning indexer may pick it, iff
t >= (e + 1) * R - 1, i.e. the token that completes a window already sees its entry; CSA entry e
pools window e - 1's first-half channels with window e's second half (window -1 adds nothing).
What made transformers' full forward and its cached decode disagree on small random configs is
not that rule but the indexer's ties: its ReLU makes exact-zero scores common where there are
few indexer heads, and ``torch.topk`` breaks ties by the shape of its input, so a one-pass
prefill picks other entries than decode does. The engine ranks equal scores by entry index,
lowest first, everywhere. Checked against transformers' own V4 blocks with that tie rule, on a
configuration with two indexer heads (ties everywhere: transformers' plain top-k moves the logits
by several units), for prompts of 30 to 600 tokens prefilled in one pass, in chunks of 7 that split
every kind of window, and token by token (the decode path)."""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import pytest
import torch

from cluster import LLM
from tests.deepseek_factories import engine_logits, make_v4_checkpoint
from tests.factories import mixed_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

Topk = collections.namedtuple("Topk", "values indices")


@contextlib.contextmanager
def ties_to_the_lowest_index() -> Iterator[None]:
    """``Tensor.topk`` (transformers' indexer picks with it; its MoE routers call ``torch.topk``)
    as a stable descending sort: equal values rank by index, lowest first."""
    original = torch.Tensor.topk

    def topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Topk:
        assert largest
        values, indices = self.sort(dim=dim, descending=True, stable=True)
        return Topk(values.narrow(dim, 0, k), indices.narrow(dim, 0, k))
    torch.Tensor.topk = topk  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.Tensor.topk = original  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def model(tmp_path_factory, one_thread):
    path = str(tmp_path_factory.mktemp("v4_ties"))
    return path, make_v4_checkpoint(path, "csa_hca", index_n_heads=2)


@pytest.mark.parametrize("length", [30, 67, 155, 300, 600])
def test_long_prompts_match_the_reference_in_one_pass_in_chunks_and_token_by_token(model, length):
    path, hf = model
    ids = mixed_prompts(512, (length,), seed=length)[0]
    with torch.no_grad():
        plain = hf(torch.tensor([ids])).logits[0].float()
        with ties_to_the_lowest_index():
            ref = hf(torch.tensor([ids])).logits[0].float()
    if length >= 67:  # the configuration has ties, and they matter
        assert (plain - ref).abs().max().item() > 0.1
    spread = (ref.max() - ref.min()).item()
    llm = LLM(path, block_size=4)
    for chunk in (length, 7, 1):
        ours = engine_logits(llm, f"probe-{chunk}", ids, 0, chunk)
        llm.engine.kv.free(f"probe-{chunk}")
        assert (ours - ref).abs().max().item() < 1e-5 * spread, chunk
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)), chunk
