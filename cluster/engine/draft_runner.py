"""DraftHeadRunner: runs the draft head (cluster.models.draft_head) next to the target model, on
the same device and KV storage (its KV is one more layer of the target's full-attention group).

The head's KV at position ``p`` is computed from the token ``x_p`` and the target's hidden state
at ``p - 1``. Per request the runner keeps what the head has not consumed yet (``DraftState``):
the first position ``start`` whose draft KV is not written, the target's hidden states from
``start - 1`` on and the tokens from ``start`` on, up to what the target has computed.

- After every target forward (``observe``): the chunk's hidden states and tokens are appended
  (first cut back to the chunk's start: a verify step's rejected positions, a preemption's
  recompute), and requests that do not draft this step catch up: one batched pass over their
  pending positions writes the draft KV (a prefill chunk's whole length, a plain decode's one).
- Before a verify step (``propose``, once the scheduler has allocated its ``1 + k`` slots): one
  pass over each request's pending positions up to its newest token, whose last row gives the
  first draft, then ``k - 1`` chained one-token passes, each reading the previous pass's output
  in place of the target's hidden state. A greedy request's drafts are the head's argmax; a
  sampled one's (``speculative_draft_sampling="coupled"``) are Gumbel-max draws from the head's
  distribution at the request's temperature with the very noise the target's draw at the same
  position uses (``DraftJob.noise``), so draft and target pick the same token wherever their
  distributions agree. The verifier's rule is unchanged (accept while a draft equals the
  target's token): the target's draws, not the drafts, make the output.
- Disaggregated: a prefill engine runs the head over the prompt (the draft KV travels with the
  rest of the blocks) and hands the hidden state at the prompt's last position to the decode
  engine (``last_hidden`` -> ``seed``), which drafts from its first step with nothing recomputed.

The head's layer of a block is complete only once it has consumed the block's last position,
which after a verify step lags the target by up to ``k + 1`` positions: ``written_upto`` tells
the scheduler how far a request's blocks may enter the prefix cache.

A request with no state and tokens before its chunk (a prefix-cache hit, a remote prefill
without a hand-over) starts with a zero hidden state at the position before: only the draft
layer's KV at that one position is approximate (acceptance, never output, can change:
``num_cold_starts`` counts them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from cluster.engine.batch import pad_tables
from cluster.engine.cuda_graphs import GraphStatus, capture_with_status
from cluster.engine.draft_graphs import DraftHeadGraphs
from cluster.engine.sampler import to_device
from cluster.models.context import ForwardContext
from cluster.models.draft_head import Drafter


@dataclass
class DraftState:
    start: int
    #: The target's hidden states at positions ``start - 1`` on ``[L, H]``.
    hidden: torch.Tensor
    #: Tokens at positions ``start`` on.
    tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class DraftJob:
    """Draft ``num_tokens`` tokens after ``token``, the request's newest, at ``position``:
    greedy, or (``noise``: the target's draw noise at the verified positions, ``[>= num_tokens,
    V]`` exponential, ``Sampler.position_noise``) each draft ``j`` drawn from the head's
    distribution at temperature ``1 / scale`` with row ``j`` of that noise."""
    request_id: str
    position: int
    token: int
    num_tokens: int
    scale: float = 1.0
    noise: Any = None


class DraftHeadRunner:
    def __init__(self, head: Drafter, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device) -> None:
        self.head = head
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.hidden_size = head.width
        self.states: dict[str, DraftState] = {}
        #: Totals (metrics, tests): head passes, positions they computed, states handed over by a
        #: prefill engine, states started without the hidden state before them.
        self.num_passes = 0
        self.num_positions = 0
        self.num_seeded = 0
        self.num_cold_starts = 0
        #: The proposal as captured CUDA graphs (``capture_graphs``), and whether it is.
        self.graphs: DraftHeadGraphs | None = None
        self.graph_status = GraphStatus(reason="not captured")
        #: Proposals replayed from a graph / run as eager passes.
        self.num_graph_proposals = 0
        self.num_eager_proposals = 0
        #: Drafts drawn from the head's distribution (sampled requests, coupled drafting).
        self.num_sampled_drafts = 0

    def capture_graphs(self, num_tokens: int, max_batch: int, table_width: int, max_model_len: int,
                       emulate: bool = False) -> GraphStatus:
        """Capture the proposal (``DraftHeadGraphs``) for up to ``max_batch`` requests drafting up
        to ``num_tokens`` each; a capture or self-check that fails leaves the passes eager, and
        the returned status (also ``graph_status``) says why."""
        if self.device.type != "cuda" and not emulate:
            self.graph_status = GraphStatus(reason=f"the device is {self.device.type}: CUDA graphs need a CUDA device")
            return self.graph_status
        graphs = DraftHeadGraphs(self, num_tokens, max_batch, table_width, max_model_len, emulate=emulate)
        self.graph_status = capture_with_status(graphs, self.device, "draft-head", "the head's passes run eagerly")
        if self.graph_status.captured:
            self.graphs = graphs
        return self.graph_status

    # --- state -----------------------------------------------------------------------------------

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def seed(self, request_id: str, position: int, hidden: torch.Tensor) -> None:
        """A prefill engine computed the draft KV below ``position`` and the target's ``hidden``
        state at ``position - 1``."""
        self.states[request_id] = DraftState(position, hidden.reshape(1, -1).to(self.device, self.head.dtype))
        self.num_seeded += 1

    def handover(self, request_id: str, tables: list[list[int]], position: int) -> bytes | None:
        """Prefill side: the hidden state the decode replica seeds the head with (float32 bytes)."""
        hidden = self.last_hidden(request_id)
        return None if hidden is None else hidden.numpy().tobytes()

    def receive(self, request_id: str, tables: list[list[int]], position: int, blob: bytes | None) -> bool:
        """Decode side: the prompt's blocks landed with ``blob`` (None: the head starts cold)."""
        if blob is None:
            return False
        self.seed(request_id, position, torch.frombuffer(bytearray(blob), dtype=torch.float32))
        return True

    def fork(self, parent: str, child: str, position: int) -> None:
        """``child`` took ``parent``'s prompt KV (a sample of the same request): it starts from
        the same hidden state, if the parent's state is still at the prompt's end."""
        st = self.states.get(parent)
        if st is not None and st.start == position and st.hidden.shape[0] == 1 and not st.tokens:
            self.states[child] = DraftState(position, st.hidden.clone())

    def resume(self, request_id: str, position: int, hidden: torch.Tensor) -> None:
        """A pipelined verify step left the request's newest token at ``position``, with the
        target's ``hidden [1, H]`` state at ``position - 1``: the head's KV is written below it
        (the device drafted on from there; a proposal made here would redo that position)."""
        self.states[request_id] = DraftState(position, hidden.to(self.head.dtype))

    def count_device_proposal(self, num_requests: int) -> None:
        """A proposal drafted on the device from a verify step (``DraftHeadGraphs.run_after_verify``)."""
        assert self.graphs is not None
        self.num_graph_proposals += 1
        self.num_passes += self.graphs.k
        self.num_positions += num_requests * (2 * self.graphs.k)  # rows computed: k + 1 and k - 1 per request

    def written_upto(self, request_id: str) -> int | None:
        """Positions below this have the head's KV written (None: no state, nothing lags)."""
        st = self.states.get(request_id)
        return None if st is None else st.start

    def last_hidden(self, request_id: str) -> torch.Tensor | None:
        """The target's hidden state before the first position the draft KV lacks, if every
        position the target computed has its draft KV (a prefill engine's hand-over)."""
        st = self.states.get(request_id)
        if st is None or st.tokens or st.hidden.shape[0] != 1:
            return None
        return st.hidden[0].float().cpu()

    def _state(self, request_id: str, position: int) -> DraftState:
        """The request's state, cut back so it covers positions below ``position`` only."""
        st = self.states.get(request_id)
        if st is not None and st.start - 1 <= position and st.start - 1 + st.hidden.shape[0] >= position:
            st.hidden = st.hidden[:position - st.start + 1]
            st.tokens = st.tokens[:max(0, position - st.start)]
            return st
        if position > 0:
            self.num_cold_starts += 1
        st = DraftState(position, torch.zeros((1, self.hidden_size), dtype=self.head.dtype,
                                              device=self.device))
        self.states[request_id] = st
        return st

    # --- passes ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def observe(self, scheduled: Sequence[Any], block_tables: dict[str, list[list[int]]],
                hidden: torch.Tensor) -> None:
        """After the target's forward over ``scheduled`` (rows of ``hidden`` in their order):
        record each chunk, then catch up the requests that verify no drafts this step."""
        row = 0
        catch_up: list[tuple[str, DraftState]] = []
        for s in scheduled:
            n = s.num_new_tokens
            start = s.num_computed_tokens
            st = self._state(s.request_id, start)
            rows = hidden[row:row + n]
            row += n
            st.hidden = torch.cat((st.hidden, rows[max(0, st.start - 1 - start):].to(st.hidden.dtype)))
            st.tokens = st.tokens + list(s.token_ids)[max(0, st.start - start):]
            if not s.draft_token_ids and st.tokens:
                catch_up.append((s.request_id, st))
        if catch_up:
            self._pass([(st.start, len(st.tokens), block_tables[rid][0]) for rid, st in catch_up],
                       [t for _, st in catch_up for t in st.tokens], torch.cat([st.hidden[:-1] for _, st in catch_up]))
            for _, st in catch_up:
                st.start += len(st.tokens)
                st.hidden = st.hidden[-1:]
                st.tokens = []

    @torch.inference_mode()
    def propose(self, jobs: Sequence[DraftJob], block_tables: dict[str, list[list[int]]]) -> dict[str, list[int]]:
        """Draft for a verify step whose slots are allocated (``block_tables``)."""
        if not jobs:
            return {}
        states = [self._state(job.request_id, job.position) for job in jobs]  # hidden rows start - 1 .. position - 1
        for job, st in zip(jobs, states):
            st.tokens = st.tokens + [job.token]
        draws = self.draw_inputs(jobs)
        if self.graphs is not None and self.graphs.can_run(jobs, states):
            self.num_graph_proposals += 1
            self.num_passes += self.graphs.k
            self.num_positions += sum(len(st.tokens) for st in states) + sum(job.num_tokens - 1 for job in jobs)
            table = self.graphs.run(jobs, states, block_tables, draws).tolist()  # the one host sync of the proposal
        else:
            self.num_eager_proposals += 1
            table = self._eager_proposal(jobs, states, block_tables, draws)
        out = {}
        for job, st, row in zip(jobs, states, table):
            st.start = job.position + 1
            st.hidden = st.hidden[:0]
            st.tokens = []
            out[job.request_id] = row[:job.num_tokens]
        return out

    def _eager_proposal(self, jobs: Sequence[DraftJob], states: Sequence[DraftState],
                        block_tables: dict[str, list[list[int]]],
                        draws: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[list[int]]:
        """The proposal as ``k`` eager passes: drafts per job (rows past a job's ``num_tokens``
        unused); ``draws`` (``draw_inputs``) where some job samples."""
        g = self._pass([(st.start, len(st.tokens), block_tables[job.request_id][0]) for job, st in zip(jobs, states)],
                       [t for st in states for t in st.tokens], torch.cat([st.hidden for st in states]),
                       last_rows=True)  # [B, H]: each request's newest position
        scale, gumbel = draws if draws is not None else (None, None)
        drafts = [self.head.draft_tokens(g, scale, None if gumbel is None else gumbel[0])]
        for j in range(1, max(job.num_tokens for job in jobs)):
            live = [i for i, job in enumerate(jobs) if job.num_tokens > j]  # no slot past a request's drafts
            index = torch.tensor(live, dtype=torch.long, device=self.device)
            g_next = self._pass([(jobs[i].position + j, 1, block_tables[jobs[i].request_id][0]) for i in live],
                                drafts[-1].index_select(0, index), g.index_select(0, index))
            g = g.index_copy(0, index, g_next)
            if gumbel is None:
                token = self.head.draft_tokens(g_next)
            else:
                token = self.head.draft_tokens(g_next, scale.index_select(0, index), gumbel[j].index_select(0, index))
            drafts.append(drafts[-1].index_copy(0, index, token))
        return torch.stack(drafts, dim=1).tolist()  # the one host sync of the proposal

    def draw_inputs(self, jobs: Sequence[DraftJob]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """None where every job drafts greedily, else ``draws_from_noise`` of the jobs' noise for
        their drafts (rows past a job's drafts, and a greedy job's, drawing nothing)."""
        sampled = [i for i, job in enumerate(jobs) if job.noise is not None]
        if not sampled:
            return None
        k = max(job.num_tokens for job in jobs)
        self.num_sampled_drafts += sum(jobs[i].num_tokens for i in sampled)
        noise = torch.ones((len(jobs), k, self.head.vocab_size), dtype=torch.float32, device=self.device)  # -log 1 = 0
        for i in sampled:
            rows = min(k, jobs[i].num_tokens)
            noise[i, :rows] = jobs[i].noise[:rows]
        return self.draws_from_noise(noise, [job.scale if job.noise is not None else 0.0 for job in jobs])

    def draws_from_noise(self, noise: torch.Tensor, scales: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale [N], gumbel [k, N, V'])`` for ``N`` requests drafting ``k`` tokens, from the
        exponential noise of the target's draws at those positions ``[N, k, V]`` and their
        ``scales`` (1 / temperature; 0: greedy, scale 1 and gumbel 0, the plain argmax): the
        noise as Gumbel noise over the draft vocabulary (``argmax(p / E) == argmax(log p - log E)``)."""
        ids = self.head.draft_vocab_ids()
        if ids is not None:
            noise = noise.index_select(2, ids.to(self.device))
        sampled = to_device([s > 0 for s in scales], torch.bool, self.device)
        gumbel = torch.where(sampled[:, None, None], noise.log().neg_(), 0.0)
        scale = to_device([s if s > 0 else 1.0 for s in scales], torch.float32, self.device)
        return scale, gumbel.transpose(0, 1)

    @property
    def draft_width(self) -> int:
        """How many tokens a draft may take (the draft vocabulary's size, else the vocabulary's)."""
        ids = self.head.draft_vocab_ids()
        return int(self.head.vocab_size if ids is None else ids.numel())

    def _pass(self, seqs: list[tuple[int, int, list[int]]], input_ids: list[int] | torch.Tensor,
              hidden: torch.Tensor, last_rows: bool = False) -> torch.Tensor:
        """One head forward over sequences (start position, length, block table row) whose
        tokens and target hidden rows are ``input_ids`` and ``hidden``, in order; returns every
        row's output, or (``last_rows``) each sequence's last."""
        counts = np.array([n for _, n, _ in seqs], dtype=np.int64)
        starts = np.array([s for s, _, _ in seqs], dtype=np.int64)
        qsl = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl[1:])
        seq_index = np.repeat(np.arange(len(seqs)), counts)
        positions = starts[seq_index] + (np.arange(int(qsl[-1])) - qsl[:-1][seq_index])
        tables = pad_tables([t for _, _, t in seqs])
        bs = self.block_size
        slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = (starts + counts).astype(np.int32)
        dev = self.device

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)
        ctx = ForwardContext(positions=to_dev(positions), query_start_loc=to_dev(qsl), seq_lens=to_dev(seq_lens),
                             query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(),
                             kv_caches=self.kv_caches, block_tables=[to_dev(tables)], slot_mappings=[to_dev(slots)],
                             block_sizes=[bs])
        if not isinstance(input_ids, torch.Tensor):
            input_ids = torch.tensor(input_ids, dtype=torch.long)
        g = self.head.draft(input_ids.to(dev), hidden, ctx)
        self.num_passes += 1
        self.num_positions += int(qsl[-1])
        if last_rows:
            return g.index_select(0, to_dev((qsl[1:] - 1).astype(np.int64)))
        return g

    def counters(self) -> dict[str, float]:
        return {"draft_head_passes_total": float(self.num_passes),
                "draft_head_positions_total": float(self.num_positions),
                "draft_head_states_handed_over_total": float(self.num_seeded),
                "draft_head_cold_starts_total": float(self.num_cold_starts),
                "draft_head_graph_proposals_total": float(self.num_graph_proposals),
                "draft_head_eager_proposals_total": float(self.num_eager_proposals)}
