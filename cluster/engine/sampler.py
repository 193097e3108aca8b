"""Sampler: turns the logits of the rows that need a next token into tokens and logprobs.

Order: logprobs are taken from the raw distribution (as vLLM does); then min_tokens masking of stop
tokens, repetition/presence/frequency penalties, greedy argmax or temperature, min-p, top-k,
top-p and a draw. Each draw uses noise from a generator seeded by (request seed, sample index,
output position), so a seeded request gets the same tokens whatever else shares the batch and
whichever worker (prefill or decode) samples a given position.

``sample_tokens`` leaves the tokens on the device and never waits for the GPU (host values reach
the device through pinned memory), so a pipelined engine can launch the next step before it reads
them; rows may then have a token still in flight (``num_pending``), which counts for their output
position."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.common.outputs import Logprob, PositionLogprobs
from cluster.common.sampling_params import SamplingParams
from kernels.sampling import apply_top_k_top_p_min_p_ref, sample_with_noise_ref


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    #: Tokens that must not be sampled yet (stop/eos ids while under min_tokens).
    banned_token_ids: tuple[int, ...]
    sample_index: int = 0
    #: Tokens already sampled for this request but not yet in ``output_token_ids`` (pipelining).
    num_pending: int = 0
    #: The draw's exponential noise ``[V]`` where it was drawn ahead (``Sampler.position_noise``:
    #: a draft sampled with it), else None: drawn at the draw.
    noise: torch.Tensor | None = None

    @property
    def needs_host_filters(self) -> bool:
        """Whether the sampler changes this row's logits before its draw with host data (banned
        tokens, penalties over its output, top-k/top-p/min-p): ``_mask_banned``, ``_apply_penalties``
        and the filter of ``_draw``. A row without is a temperature and a noise alone, which a
        captured graph can draw (``VerifyGraphs.run_sampled``)."""
        return bool(self.banned_token_ids) or self.params.has_penalties or self.params.has_filters


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without a synchronisation: through pinned memory (torch's
    caching host allocator keeps the buffer until the copy has run)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class Sampler:
    def __init__(self, vocab_size: int, seed: int, device: torch.device,
                 filter_fn: Callable[..., torch.Tensor] = apply_top_k_top_p_min_p_ref) -> None:
        self.vocab_size = vocab_size
        self.filter_fn = filter_fn
        self.device = device
        self._unseeded = torch.Generator(device=device)
        self._unseeded.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]
                 ) -> tuple[list[int], list[PositionLogprobs | None]]:
        logits = logits[:, : self.vocab_size].float()  # [N, V]
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = logits.log_softmax(-1) if any(want_logprobs) else None
        token_list = self.sample_tokens(logits, rows).tolist()
        logprobs: list[PositionLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            logprobs = self._gather_logprobs(raw_logprobs, token_list, rows)
        return token_list, logprobs

    def sample_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The next token of every row, ``[N]`` int64 on the device; no host synchronisation."""
        logits = logits[:, : self.vocab_size].float()
        logits = self._mask_banned(logits, rows)
        logits = self._apply_penalties(logits, rows)
        return self._draw(logits, rows)

    def _mask_banned(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            if row.banned_token_ids:
                ids = [t for t in row.banned_token_ids if t < self.vocab_size]
                if ids:
                    logits[i].index_fill_(0, to_device(ids, torch.long, logits.device), float("-inf"))
        return logits

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            p = row.params
            if not p.has_penalties:
                continue
            out_ids = to_device(row.output_token_ids, torch.long, logits.device)
            counts = torch.bincount(out_ids, minlength=self.vocab_size)[: self.vocab_size].float()
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                if row.prompt_token_ids:
                    prompt_ids = to_device(row.prompt_token_ids, torch.long, logits.device)
                    seen[prompt_ids[prompt_ids < self.vocab_size]] = True
                penalised = torch.where(logits[i] > 0, logits[i] / p.repetition_penalty,
                                        logits[i] * p.repetition_penalty)
                logits[i] = torch.where(seen, penalised, logits[i])
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        tokens = logits.argmax(-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            return tokens
        index = to_device(random_rows, torch.long, logits.device)
        sub = logits.index_select(0, index)
        params = [rows[i].params for i in random_rows]
        dev = sub.device
        sub = sub / to_device([p.temperature for p in params], torch.float32, dev)[:, None]
        top_k = to_device([p.top_k for p in params], torch.long, dev) if any(p.top_k > 0 for p in params) else None
        top_p = to_device([p.top_p for p in params], torch.float32, dev) if any(
            p.top_p < 1.0 for p in params) else None
        min_p = to_device([p.min_p for p in params], torch.float32, dev) if any(
            p.min_p > 0 for p in params) else None
        sub = self.filter_fn(sub, top_k, top_p, min_p)
        probs = sub.softmax(-1)
        noise = self._fill_noise(torch.empty_like(probs), [rows[i] for i in random_rows])
        tokens.index_copy_(0, index, sample_with_noise_ref(probs, noise))
        return tokens

    def position_noise(self, rows: list[SamplingRow]) -> torch.Tensor:
        """The exponential noise ``[len(rows), V]`` that ``_draw`` would draw for each row (a
        sampled row: seeded, the same values whenever drawn; unseeded, the next from the engine's
        generator): drawn ahead, a draft sampled with a position's noise is the token the target
        draws there wherever their distributions agree (``SamplingRow.noise`` hands it to the
        draw)."""
        return self._fill_noise(torch.empty((len(rows), self.vocab_size), dtype=torch.float32, device=self.device),
                                rows)

    def _fill_noise(self, noise: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Row ``j`` of ``noise`` the exponential noise ``rows[j]`` draws with: its noise drawn
        ahead, else from its generator (``_generator_for``)."""
        for j, row in enumerate(rows):
            if row.noise is not None:
                noise[j].copy_(row.noise)
            else:
                noise[j].exponential_(generator=self._generator_for(row))
        return noise

    def unseeded_noise(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Exponential noise ``[*shape, V]`` from the engine's generator, for unseeded rows drawn
        ahead (``SamplingRow.noise``)."""
        noise = torch.empty((*shape, self.vocab_size), dtype=torch.float32, device=self.device)
        return noise.exponential_(generator=self._unseeded)

    def seeded_noise(self, row: SamplingRow, positions: range, cache: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """The exponential noise ``[V]`` a seeded row draws with at each output position of
        ``positions`` (whatever its own position), the same values ``_draw`` takes there; kept in
        ``cache`` (position -> noise), from which positions before ``positions`` are dropped."""
        assert row.params.seed is not None
        for old in [q for q in cache if q < positions.start]:
            del cache[old]
        for position in positions:
            if position not in cache:
                noise = torch.empty(self.vocab_size, dtype=torch.float32, device=self.device)
                cache[position] = noise.exponential_(generator=self._generator_for(row, position))
        return [cache[position] for position in positions]

    def _generator_for(self, row: SamplingRow, position: int | None = None) -> torch.Generator:
        """``row``'s generator: seeded, one seeded by (seed, sample index, output position:
        ``position``, else the row's own); unseeded, the engine's."""
        seed = row.params.seed
        if seed is None:
            return self._unseeded
        gen = torch.Generator(device=self.device)
        if position is None:
            position = len(row.output_token_ids) + row.num_pending
        gen.manual_seed(hash((seed, row.sample_index, position)) & 0x7FFF_FFFF_FFFF_FFFF)
        return gen

    def _gather_logprobs(self, raw: torch.Tensor, tokens: list[int],
                         rows: list[SamplingRow]) -> list[PositionLogprobs | None]:
        max_n = max((r.params.logprobs or 0) for r in rows)
        top_vals, top_ids = raw.topk(max(1, max_n), dim=-1)
        token_t = torch.tensor(tokens, device=raw.device)
        chosen = raw.gather(1, token_t[:, None])[:, 0]
        ranks = (raw > chosen[:, None]).sum(-1) + 1
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        chosen_l, ranks_l = chosen.tolist(), ranks.tolist()
        result: list[PositionLogprobs | None] = []
        for i, row in enumerate(rows):
            n = row.params.logprobs
            if n is None:
                result.append(None)
                continue
            entry: PositionLogprobs = {tokens[i]: Logprob(chosen_l[i], ranks_l[i])}
            for rank, (tid, val) in enumerate(zip(top_ids_l[i][:n], top_vals_l[i][:n]), start=1):
                entry.setdefault(tid, Logprob(val, rank))
            result.append(entry)
        return result
