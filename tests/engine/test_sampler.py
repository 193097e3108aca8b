"""Sampler: greedy, filters, penalties, min_tokens bans, per-request seeds independent of the
batch, logprobs."""
from __future__ import annotations

import math

import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.sampler import Sampler, SamplingRow
from kernels.sampling import apply_top_k_top_p_min_p_ref

V = 50


def row(prompt=(), output=(), banned=(), index=0, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), tuple(banned), index)


def logits(n: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits(3)
    tokens, _ = Sampler(V, 0, torch.device("cpu"))(x.clone(), [row(temperature=0.0)] * 3)
    assert tokens == x.argmax(-1).tolist()


def test_top_k_top_p_min_p_filters():
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    kept = lambda out: (out > float("-inf")).nonzero()[:, 1].tolist()  # noqa: E731
    assert kept(apply_top_k_top_p_min_p_ref(x, torch.tensor([2]), None, None)) == [0, 1]
    probs = x.softmax(-1)[0]
    p = (probs[0] + probs[1] * 0.5).item()  # needs the first two tokens
    assert kept(apply_top_k_top_p_min_p_ref(x, None, torch.tensor([p]), None)) == [0, 1]
    assert kept(apply_top_k_top_p_min_p_ref(x, None, torch.tensor([1e-6]), None)) == [0]
    ratio = (probs[2] / probs[0]).item()
    assert kept(apply_top_k_top_p_min_p_ref(x, None, None, torch.tensor([ratio * 0.99]))) == [0, 1, 2]


def test_seeded_rows_do_not_depend_on_the_batch():
    sampler = Sampler(V, 0, torch.device("cpu"))
    x = logits(4, seed=3)
    alone, _ = sampler(x[1:2].clone(), [row(output=[1, 2], temperature=1.0, seed=42)])
    mixed_rows = [row(temperature=1.0), row(output=[1, 2], temperature=1.0, seed=42),
                  row(temperature=0.7, seed=5), row(temperature=0.0)]
    batch, _ = sampler(x.clone(), mixed_rows)
    assert batch[1] == alone[0]
    # a different position gives a fresh draw stream; the same position repeats
    again, _ = sampler(x[1:2].clone(), [row(output=[1, 2], temperature=1.0, seed=42)])
    assert again == alone


def test_seeded_sampling_follows_the_distribution():
    sampler = Sampler(V, 0, torch.device("cpu"))
    x = torch.full((1, V), -30.0)
    x[0, 3], x[0, 7] = 0.0, math.log(3.0)  # p(3) = 0.25, p(7) = 0.75
    draws = [sampler(x.clone(), [row(output=[0] * i, temperature=1.0, seed=1)])[0][0] for i in range(400)]
    assert set(draws) == {3, 7}
    assert 0.65 < draws.count(7) / len(draws) < 0.85


def test_penalties():
    sampler = Sampler(V, 0, torch.device("cpu"))
    x = torch.zeros(1, V)
    x[0, 5] = 2.0
    x[0, 6] = 1.9
    # token 5 was generated twice: frequency penalty 0.1 * 2 makes 6 the argmax
    tokens, _ = sampler(x.clone(), [row(output=[5, 5], temperature=0.0, frequency_penalty=0.1)])
    assert tokens == [6]
    tokens, _ = sampler(x.clone(), [row(output=[5], temperature=0.0, presence_penalty=0.2)])
    assert tokens == [6]
    tokens, _ = sampler(x.clone(), [row(prompt=[5], temperature=0.0, repetition_penalty=1.2)])
    assert tokens == [6]
    tokens, _ = sampler(x.clone(), [row(prompt=[5], temperature=0.0)])
    assert tokens == [5]


def test_banned_tokens_are_never_drawn():
    sampler = Sampler(V, 0, torch.device("cpu"))
    x = logits(1)
    best = int(x.argmax())
    tokens, _ = sampler(x.clone(), [row(banned=[best], temperature=0.0)])
    assert tokens[0] != best


def test_logprobs_are_from_the_raw_distribution():
    sampler = Sampler(V, 0, torch.device("cpu"))
    x = logits(2, seed=9)
    tokens, lps = sampler(x.clone(), [row(temperature=0.0, logprobs=3), row(temperature=0.0)])
    ref = x.log_softmax(-1)
    assert lps[1] is None
    entry = lps[0]
    assert entry is not None and tokens[0] in entry and entry[tokens[0]].rank == 1
    top = ref[0].topk(3)
    for rank, (val, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        assert abs(entry[tid].logprob - val) < 1e-5 and entry[tid].rank == rank


def test_noise_drawn_ahead_is_the_draws_and_couples_a_gumbel_draft():
    """``position_noise`` gives the noise ``_draw`` draws with (a seeded row: the same values
    whenever drawn; an unseeded one: handed to the draw through ``SamplingRow.noise``), and a
    Gumbel-max draft from the same distribution with that noise (``perturbed_argmax``, as the
    draft head draws) is the draw's token, row by row."""
    from cluster.models.draft_head import perturbed_argmax
    x = logits(6, seed=5)
    rows = [row(output=[1] * j, temperature=t, seed=s) for j, (t, s) in
            enumerate(((1.0, 3), (0.6, 3), (1.3, 8), (1.0, None), (0.8, None), (1.0, 11)))]
    sampler = Sampler(V, 0, torch.device("cpu"))
    noise = sampler.position_noise(rows)
    assert noise.shape == (6, V) and bool((noise > 0).all())
    for r, e in zip(rows, noise):
        if r.params.seed is None:
            r.noise = e  # an unseeded row's noise drawn ahead is the one it draws with
    drawn, _ = sampler(x.clone(), rows)
    assert torch.equal(Sampler(V, 0, torch.device("cpu")).position_noise(rows[:3]), noise[:3])  # seeded: repeatable
    scale = torch.tensor([1.0 / r.params.temperature for r in rows])
    assert perturbed_argmax(x, scale, -noise.log()).tolist() == drawn
    assert perturbed_argmax(x, None, None).tolist() == x.argmax(-1).tolist()
    # an unseeded row without noise ahead draws fresh noise: other tokens at times
    fresh = [sampler(x[3:4].clone(), [row(temperature=1.0)])[0][0] for _ in range(40)]
    assert len(set(fresh)) > 1
