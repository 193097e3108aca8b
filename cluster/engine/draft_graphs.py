"""DraftHeadGraphs: the draft head's whole proposal for a verify step (its first pass and the
``k - 1`` chained ones, each with its argmax over the shared LM head) replayed as one captured
CUDA graph per padded batch size.

Eagerly, a proposal is ``k`` head forwards of a few dozen small kernels each, launched from
Python: on a GPU that costs more than the verify step itself. In a graph it is one launch.

Layout (every row a decode row: one query at its own position, ``seq_len = position + 1``, so
the decode attention kernel serves it and a row's KV, written before attention, is seen by the
rows after it in the same sequence, as in a verify step's graph):

- First pass: ``k + 1`` rows per request, the most positions a request can have pending (a
  verify step that accepted all ``k`` drafts, plus the bonus token). Request ``i`` owns rows
  ``i * (k + 1) ..``; its pending positions fill the first of them, the rest are padding (slot
  -1: they write nowhere; their output is never read). ``last_rows`` names each request's newest
  position's row, whose output gives the first draft.
- Chained pass ``j``: one row per request at ``position + j``, reading the previous pass's output
  as the target's hidden state and its argmax as the token. A request that drafts fewer than
  ``k`` tokens (near its ``max_tokens``) has no slot there: slot -1, its row's drafts dropped.

- Sampled drafts (DraftHeadRunner, ``DraftJob.noise``): each draft is ``argmax(logits * scale +
  gumbel)`` with per-request ``scale`` and per-pass ``gumbel`` buffers, which hold 1 and 0 for a
  greedy request (the plain argmax). Where those buffers would pass ``MAX_DRAW_BUFFER_BYTES``
  (a large vocabulary without a draft vocabulary), the graphs draft greedily for every request
  and say so (``draws``); eager proposals still sample.

Requests beyond the batch (padding up to the graph's size) read the null block and write nowhere.
The inputs go through one pinned host buffer and one copy (no wait for the GPU); the pending
hidden rows are copied on the device. ``emulate=True`` (CPU tests): no capture; each replay runs
the forward on the static buffers under :class:`GraphSafetyCheck`, as DecodeGraphs does.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from cluster.engine.cuda_graphs import EmulatedGraph, GraphUnsafeError, warm_and_capture, graph_batch_sizes, stage
from cluster.models.context import ForwardContext
from cluster.models.ops import Ops

if TYPE_CHECKING:
    from cluster.engine.draft_runner import DraftHeadRunner, DraftJob, DraftState

logger = logging.getLogger(__name__)

#: The most memory the graphs' sampled-draft buffers (``gumbel [k, batch, draft vocabulary]``
#: float32) may take; beyond it the graphs draft greedily.
MAX_DRAW_BUFFER_BYTES = 64 << 20


class DraftHeadGraphs:
    def __init__(self, drafter: "DraftHeadRunner", num_tokens: int, max_batch: int, table_width: int,
                 max_model_len: int, emulate: bool = False) -> None:
        self.drafter = drafter
        self.emulate = emulate
        self.ops: Ops = drafter.head.ops
        self.k = num_tokens
        self.rows = num_tokens + 1
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = b = self.sizes[-1]
        r, dev = self.rows, drafter.device
        with torch.device(dev):
            self.first_ids = torch.zeros(b * r, dtype=torch.int64)
            self.first_positions = torch.zeros(b * r, dtype=torch.int64)
            self.first_seq_lens = torch.ones(b * r, dtype=torch.int32)
            self.first_slots = torch.full((b * r,), -1, dtype=torch.int64)
            self.first_hidden = torch.zeros((b * r, drafter.hidden_size), dtype=drafter.head.dtype)
            #: Row ``j`` of the first pass belongs to request ``j // (k + 1)``: a constant.
            self.row_request = torch.arange(b, dtype=torch.int64).repeat_interleave(r)
            self.last_rows = torch.arange(b, dtype=torch.int64) * r
            self.chain_positions = torch.zeros((max(1, self.k - 1), b), dtype=torch.int64)
            self.chain_seq_lens = torch.ones((max(1, self.k - 1), b), dtype=torch.int32)
            self.chain_slots = torch.full((max(1, self.k - 1), b), -1, dtype=torch.int64)
            self.tables = torch.zeros((b, table_width), dtype=torch.int32)
            self.query_start_loc = torch.arange(b * r + 1, dtype=torch.int32)
        width = drafter.draft_width
        need = self.k * b * width * 4
        #: Whether the graphs draw sampled drafts (else greedy for all), and why not.
        self.draws = need <= MAX_DRAW_BUFFER_BYTES
        self.draws_reason = "" if self.draws else (
            f"sampled requests draft greedily in the graphs: their draw buffers would take {need >> 20} MiB "
            f"(k={self.k}, batch {b}, {width} draftable tokens; at most {MAX_DRAW_BUFFER_BYTES >> 20} MiB)")
        if not self.draws:
            logger.warning("draft-head graphs: %s", self.draws_reason)
        with torch.device(dev):
            self.scale = torch.ones(b if self.draws else 0, dtype=torch.float32)
            self.gumbel = torch.zeros((self.k, b, width) if self.draws else (0,), dtype=torch.float32)
        #: Whether ``scale``/``gumbel`` hold a sampled request's values (``neutral`` resets them).
        self._drawn = False
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.timings: dict[str, float] = {}
        self.verified_size = 0

    # --- the captured forward ----------------------------------------------------------------------

    def _context(self, positions: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor,
                 slots: torch.Tensor) -> ForwardContext:
        n = positions.shape[0]
        return ForwardContext(
            positions=positions, query_start_loc=self.query_start_loc[:n + 1], seq_lens=seq_lens,
            query_start_loc_cpu=list(range(n + 1)),
            # the decode kernel sizes its split count from the longest possible context
            seq_lens_cpu=[self.max_model_len] * n, kv_caches=self.drafter.kv_caches, block_tables=[tables],
            slot_mappings=[slots], block_sizes=[self.drafter.block_size])

    def forward(self, size: int) -> torch.Tensor:
        """The proposal on the first ``size`` requests' buffers: drafts ``[size, k]``."""
        d = self.drafter
        n = size * self.rows
        tables = self.tables[:size]
        ctx = self._context(self.first_positions[:n], self.first_seq_lens[:n],
                            tables.index_select(0, self.row_request[:n]), self.first_slots[:n])
        hidden = self.first_hidden[:n]
        g = d.head.draft(self.first_ids[:n], hidden, ctx)
        g = g.index_select(0, self.last_rows[:size])
        token = self._draft_tokens(g, 0, size)
        drafts = [token]
        for j in range(self.k - 1):
            ctx = self._context(self.chain_positions[j, :size], self.chain_seq_lens[j, :size], tables,
                                self.chain_slots[j, :size])
            g = d.head.draft(token, g, ctx)
            token = self._draft_tokens(g, j + 1, size)
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    def _draft_tokens(self, g: torch.Tensor, j: int, size: int) -> torch.Tensor:
        if not self.draws:
            return self.drafter.head.draft_tokens(g)
        return self.drafter.head.draft_tokens(g, self.scale[:size], self.gumbel[j, :size])

    def neutral(self, draws: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Every request drafts greedily (after a proposal that sampled), or with ``draws``
        (``DraftHeadRunner.draws_from_noise``: ``scale [n]``, ``gumbel [<= k, n, V']``) the
        first ``n`` requests draw theirs (where the graphs draw at all)."""
        if self._drawn:
            self.scale.fill_(1.0)
            self.gumbel.zero_()
            self._drawn = False
        if self.draws and draws is not None:
            scale, gumbel = draws
            self.gumbel[:gumbel.shape[0], :gumbel.shape[1]].copy_(gumbel)
            self.scale[:scale.shape[0]].copy_(scale)
            self._drawn = True

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every size up eagerly (compilation, autotuning), capture from the largest size
        down in one memory pool, then ``verify``."""
        self._clear()
        if self.emulate:
            self.graphs = {size: EmulatedGraph(self, size) for size in self.sizes}
            self.verified_size = self.verify()
            return
        self.graphs, = warm_and_capture([(self.forward, self.outputs)], self.sizes, self.drafter.device,
                                        self.timings, "draft_")
        self.verified_size = self.verify()
        logger.info("captured draft-head CUDA graphs for batch sizes %s (batch %d verified against the eager "
                    "passes)", self.sizes, self.verified_size)

    def _clear(self) -> None:
        """Every row reads the null block and writes nowhere."""
        self.first_slots.fill_(-1)
        self.chain_slots.fill_(-1)
        self.tables.zero_()
        self.first_positions.zero_()
        self.first_seq_lens.fill_(1)
        self.chain_positions.zero_()
        self.chain_seq_lens.fill_(1)

    @torch.inference_mode()
    def verify(self) -> int:
        """Replay the largest graph on inputs it was not captured with (random tokens, hidden
        states and positions; every row reading the null block, none writing) and compare with
        the same forward run eagerly: a graph that froze a value at capture drafts other tokens.
        Raises GraphUnsafeError (the head then drafts eagerly)."""
        size = self.sizes[-1]
        dev = self.drafter.device
        gen = torch.Generator(device=dev).manual_seed(0)
        vocab = self.drafter.head.vocab_size
        n = size * self.rows
        self._clear()
        self.first_ids[:n].copy_(torch.randint(0, vocab, (n,), generator=gen, device=dev))
        self.first_hidden[:n].copy_(torch.randn((n, self.drafter.hidden_size), generator=gen, device=dev))
        self.last_rows[:size].copy_(torch.arange(size, device=dev) * self.rows
                                    + torch.randint(0, self.rows, (size,), generator=gen, device=dev))
        try:
            expected = self.forward(size)
            self.graphs[size].replay()
            got = self.outputs[size]
        finally:
            self._clear()
        agree = float((got == expected).float().mean())
        # float rounding may flip a near-tie; a frozen input changes nearly every draft
        if agree < 0.9:
            raise GraphUnsafeError(f"draft-head graph of batch {size} replayed other drafts than the eager "
                                   f"passes ({agree:.0%} agree)")
        return size

    # --- serving -----------------------------------------------------------------------------------

    def can_run(self, jobs: Sequence["DraftJob"], states: Sequence["DraftState"]) -> bool:
        return (bool(self.graphs) and 0 < len(jobs) <= self.max_batch
                and all(1 <= len(st.tokens) <= self.rows and job.num_tokens <= self.k for job, st in zip(jobs, states)))

    @torch.inference_mode()
    def run(self, jobs: Sequence["DraftJob"], states: Sequence["DraftState"],
            block_tables: dict[str, list[list[int]]],
            draws: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Drafts ``[len(jobs), k]`` on the device (a request's row past its ``num_tokens`` is
        unused) for requests whose pending tokens (``states``, the newest included) fit; with
        ``draws`` (``DraftHeadRunner.draw_inputs``) the sampled jobs draw theirs."""
        n = len(jobs)
        self.neutral(draws)
        size = next(s for s in self.sizes if s >= n)
        r, k, bs = self.rows, self.k, self.drafter.block_size
        chain = max(1, k - 1)
        width = self.tables.shape[1]
        tables = np.zeros((size, width), dtype=np.int64)
        counts = np.zeros(size, dtype=np.int64)
        starts = np.zeros(size, dtype=np.int64)
        ids = np.zeros((size, r), dtype=np.int64)
        for i, (job, st) in enumerate(zip(jobs, states)):
            table = block_tables[job.request_id][0]
            tables[i, :len(table)] = table
            counts[i] = len(st.tokens)
            starts[i] = st.start
            ids[i, :counts[i]] = st.tokens
        offsets = np.arange(r)
        real = offsets[None, :] < counts[:, None]  # [size, r]
        positions = np.where(real, starts[:, None] + offsets[None, :], 0)
        rows = np.arange(size)[:, None]
        slots = np.where(real, tables[rows, positions // bs] * bs + positions % bs, -1)
        last = np.arange(size) * r + np.maximum(counts - 1, 0)
        newest = np.array([job.position for job in jobs] + [0] * (size - n), dtype=np.int64)
        drafting = np.array([job.num_tokens for job in jobs] + [0] * (size - n), dtype=np.int64)
        chain_pos = newest[None, :] + np.arange(1, chain + 1)[:, None]  # [chain, size]
        live = np.arange(1, chain + 1)[:, None] < drafting[None, :]
        block = np.minimum(chain_pos // bs, width - 1)
        chain_slots = np.where(live, tables[np.arange(size)[None, :], block] * bs + chain_pos % bs, -1)
        chain_pos = np.where(live, chain_pos, 0)
        hidden_rows = (np.arange(size)[:, None] * r + offsets[None, :])[real]
        # (target, values) in one pinned buffer, one copy
        columns = [(self.first_ids[:size * r], ids.reshape(-1)), (self.first_positions[:size * r], positions.reshape(-1)),
                   (self.first_seq_lens[:size * r], positions.reshape(-1) + 1),
                   (self.first_slots[:size * r], slots.reshape(-1)), (self.last_rows[:size], last),
                   (self.chain_positions[:, :size], chain_pos), (self.chain_seq_lens[:, :size], chain_pos + 1),
                   (self.chain_slots[:, :size], chain_slots), (self.tables[:size], tables), (None, hidden_rows)]
        host = np.concatenate([v.reshape(-1) for _, v in columns])
        staged = stage(host, self.drafter.device)
        offset = 0
        for target, values in columns:
            part = staged[offset:offset + values.size]
            offset += values.size
            if target is None:
                self.first_hidden.index_copy_(0, part, torch.cat([st.hidden for st in states]).to(self.first_hidden.dtype))
            else:
                target.copy_(part.view(target.shape))
        self.graphs[size].replay()
        return self.outputs[size][:n]

    @torch.inference_mode()
    def run_after_verify(self, tables: torch.Tensor, base: torch.Tensor, inputs: torch.Tensor,
                         targets: torch.Tensor, hidden: torch.Tensor, live: torch.Tensor | None = None,
                         replay: bool = True, draws: tuple[torch.Tensor, torch.Tensor] | None = None,
                         window: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Accept a verify step's drafts and draft the next ones, for ``n`` requests, from values
        on the device alone (pipelined speculative decoding): ``tables [n, W]`` their block
        tables, ``base [n]`` the verify step's first position, ``inputs [n, k + 1]`` its input
        tokens (the last known token, then the drafts), ``targets [n, k + 1]`` the target's token
        at each of those positions and ``hidden [n * (k + 1), H]`` its rows' hidden states.
        Returns ``(drafts [n, k], accepted [n], token [n])``: the drafts are accepted while they
        equal the target's tokens, ``token`` is the target's after them. Every request drafts
        ``k`` tokens (the caller leaves room for them); one whose ``live`` is false (padding)
        writes nowhere. Replays the graph, or (``replay=False``, inside another graph's capture)
        runs its forward on the buffers.

        The first pass covers the positions ``base + 1 .. base + accepted + 1`` (the accepted
        drafts, then ``token``), each reading the verify row before it (``last_rows`` names the
        newest), exactly the pending positions of ``run``; rows past them write nowhere. The rows
        come from one kernel (``Ops.spec_accept_draft_rows``). ``draws`` (replayed only; see
        ``run``): the sampled requests draw their drafts with the next verify step's noise.
        ``window`` (``gumbel [L, n, V']``, ``start [n]``, ``rows [n]`` bool; replayed, with
        ``draws``; inside a capture, on the static buffers of ``VerifyGraphs``) the requests of
        ``rows`` (seeded, whose noise depends on the position the acceptance sets) draw draft
        ``j`` with ``gumbel[start + accepted + j]`` instead."""
        n = base.shape[0]
        size = next(s for s in self.sizes if s >= n)
        r = self.rows
        if replay:
            self.neutral(draws)
        accepted, token = self.ops.spec_accept_draft_rows(
            inputs, targets, base, live, tables, self.drafter.block_size, self.first_ids[:size * r],
            self.first_positions[:size * r], self.first_seq_lens[:size * r], self.first_slots[:size * r],
            self.last_rows[:size], self.chain_positions[:, :size], self.chain_seq_lens[:, :size],
            self.chain_slots[:, :size], self.tables[:size])
        if window is not None and (self._drawn or not replay):
            gumbel, start, rows = window
            index = (start + accepted)[None, :] + torch.arange(self.k, device=start.device)[:, None]  # [k, n]
            chosen = gumbel.gather(0, index[:, :, None].expand(-1, -1, gumbel.shape[2]))
            drawn = self.gumbel[:, :n]
            drawn.copy_(torch.where(rows[None, :, None], chosen, drawn))
        self.first_hidden[:n * r].copy_(hidden)
        if not replay:
            return self.forward(size)[:n], accepted, token
        self.graphs[size].replay()
        return self.outputs[size][:n], accepted, token
