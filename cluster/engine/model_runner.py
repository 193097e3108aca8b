"""ModelRunner: owns the model, the KV storage tensors and the sampler on one device. Each step it
turns a SchedulerOutput (its only input: no live request is read here) into the batch's inputs
(token ids, positions, per-group block tables and slot mappings), runs the model, and samples the
rows whose chunk reached the end of the request."""
from __future__ import annotations

import math
from functools import cached_property
from collections.abc import Callable, Sequence
from typing import Any, cast
from dataclasses import dataclass, field

import numpy as np
import torch

from cluster.common.kv_spec import KVGroupSpec
from cluster.common.outputs import PositionLogprobs
from cluster.common.sampling_params import SamplingParams
from cluster.engine.batch import HostBatch, build_host_batch, take_pending_tokens
from cluster.engine.cuda_graphs import (DecodeGraphs, GraphStatus, GraphUnsafeError, capture_with_status, fetch,
                                       stage_tables)
from cluster.engine.draft_runner import DraftHeadRunner, DraftJob
from cluster.engine.sampler import Sampler, SamplingRow, to_device
from cluster.engine.request import Request
from cluster.engine.scheduler import ScheduledRequest, SchedulerOutput
from cluster.engine.verify_step import VerifyGraphs, VerifyOutputs, verify_on_device
from cluster.models.context import ForwardContext

@dataclass
class RunnerOutput:
    #: request id -> sampled token, for requests whose chunk reached their end.
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs | None] = field(default_factory=dict)
    #: Verify steps (speculative decoding): request id -> the target's token at each of the
    #: chunk's last ``k + 1`` positions, and their logprobs.
    verified: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)
    #: Verify steps: request id -> the ordinal of its first verified position among the step's
    #: (the rows of ``ModelRunner.verify_states`` its positions' states went to).
    verify_slots: dict[str, int] = field(default_factory=dict)


@dataclass
class VerifyLaunch:
    """A verify step launched with its acceptance and the draft head's next proposal on the
    device (pipelined speculative decoding, ``ModelRunner.launch_verify``): nothing read yet."""

    outputs: VerifyOutputs
    #: The rows' tokens then the drafts accepted (int64), copied to the host asynchronously, and
    #: the event after the copy (None on a CPU, where everything has run).
    host: torch.Tensor
    done: torch.cuda.Event | None
    #: The next verify step's draw noise ``[n, k + 1, V]`` (drawn here, unseeded), which the
    #: sampled requests' next drafts were drawn with; None where none samples coupled.
    next_noise: torch.Tensor | None = None


@dataclass
class SeededWindow:
    """Seeded requests in a pipelined verify step (``ModelRunner.launch_verify``), whose draw
    noise is a function of the output position, which the host does not know there: ``noise
    [n, L, V]`` each request's noise at ``L`` output positions from one the host knows (zeros
    for the others), ``offset [n]`` (on the device) where in it the step's first verified position
    lies (the accepted drafts of the step in flight, plus one; 0 when the host knows the
    position), ``seeded [n]`` which requests are seeded. The step's rows draw with
    ``noise[i, offset + j]``; a coupled head's next drafts with ``noise[i, offset + accepted + 1 + j]``."""

    noise: torch.Tensor
    offset: torch.Tensor
    seeded: list[bool]

    @cached_property
    def mask(self) -> torch.Tensor:
        """``seeded`` on the device (one copy however often a launch asks)."""
        return to_device(self.seeded, torch.bool, self.offset.device)

    def verify_noise(self, rows: int) -> torch.Tensor:
        """``[n, rows, V]`` the step's rows' noise."""
        index = self.offset[:, None] + torch.arange(rows, device=self.offset.device)
        return self.noise.gather(1, index[:, :, None].expand(-1, -1, self.noise.shape[2]))


#: Allocates KV storage ``[num_blocks, num_layers, *block_shape]`` per group (e.g. in shared memory
#: so a transfer backend can move it): (specs, num_blocks, device, dtypes) -> tensors.
KVAllocator = Callable[[list[KVGroupSpec], list[int], torch.device, list[torch.dtype]], list[torch.Tensor]]


#: How the start-up warm-up samples its prompts' last rows: the greedy path, and a seeded draw
#: through the filters.
WARMUP_SAMPLING = (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=0))


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8}[name]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, specs: list[KVGroupSpec], num_blocks: list[int],
                 device: torch.device, seed: int, kv_allocator: KVAllocator | None = None) -> None:
        self.model = model
        self.specs = specs
        self.device = device
        dtypes = [torch_dtype(spec.dtype) for spec in specs]
        if kv_allocator is None:
            self.kv_caches = [torch.zeros((n, spec.num_layers, *spec.block_shape), dtype=dt, device=device)
                              for spec, n, dt in zip(specs, num_blocks, dtypes)]
        else:
            self.kv_caches = kv_allocator(specs, num_blocks, device, dtypes)
        self.graphs: DecodeGraphs | None = None
        #: The draft head's runner (speculative_method=draft_head), set by the engine.
        self.drafter: DraftHeadRunner | None = None
        self.graph_status = GraphStatus(reason="not captured")
        #: Greedy pipelined verify steps as one graph each (``capture_verify_graphs``).
        self.verify_graphs: VerifyGraphs | None = None
        self.verify_graph_status = GraphStatus(reason="not captured")
        #: Forward passes replayed from a decode graph / run eagerly / pipelined verify steps
        #: replayed from a verify-step graph (metrics, benchmarks).
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        self.num_verify_graph_steps = 0
        #: Of those, the steps of batches with sampled requests (``VerifyGraphs.run_sampled``).
        self.num_sampled_verify_graph_steps = 0
        #: Pipelined verify launches that drew the next step's noise for coupled drafts, and
        #: that had seeded requests (``SeededWindow``).
        self.num_noise_launches = 0
        self.num_seeded_launches = 0
        #: Verify steps of a model with ``state`` KV groups (updated in place): per group, rows for
        #: the verified positions' states (``enable_verify_states``), None for other groups.
        self.verify_states: list[torch.Tensor | None] | None = None
        ops = getattr(model, "ops", None)
        self.sampler = Sampler(model.vocab_size, seed, device, *((ops.sampling,) if ops is not None else ()))

    def capture_cuda_graphs(self, max_batch: int, max_model_len: int, emulate: bool = False,
                            verify_depth: int = 1) -> GraphStatus:
        """Capture decode graphs when the device and the model's kernels allow it; the returned
        status (also ``graph_status``) says which sizes, or why not. A capture or a self-check
        that fails leaves the runner eager. ``emulate``: graphs emulated on any device (tests: see
        :class:`DecodeGraphs`)."""
        blocker = getattr(self.model, "cuda_graph_blocker", "the model declares no CUDA graph support")
        if self.device.type != "cuda" and not emulate:
            blocker = f"the device is {self.device.type}: CUDA graphs need a CUDA device"
        if blocker is not None:
            self.graph_status = GraphStatus(reason=blocker)
            return self.graph_status
        graphs = DecodeGraphs(self.model, self.specs, self.kv_caches, self.device, max_batch, max_model_len,
                              emulate=emulate, verify_states=self.verify_states, verify_depth=verify_depth)
        self.graph_status = capture_with_status(graphs, self.device, "decode", "decode steps run eagerly")
        if self.graph_status.captured:
            self.graphs = graphs
        return self.graph_status

    @torch.inference_mode()
    def forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[tuple[int, ScheduledRequest]]]:
        """Run the model on the step's tokens (writing their KV); returns the final hidden states
        ``[T, H]`` and, for each request to sample, the row of its last token."""
        batch = build_host_batch(sched.scheduled, sched.block_tables, self.specs)
        if self.graphs is not None and self.graphs.can_run(batch):
            self.num_graph_steps += 1
            return self.graphs.run(batch), batch.sample_rows
        self.num_eager_steps += 1
        ctx, input_ids = self._context(batch)
        return self.model(input_ids, ctx), batch.sample_rows

    @torch.inference_mode()
    def warm_prefill(self, num_tokens: int, tables: list[list[int]]) -> None:
        """Run one prompt of ``num_tokens`` tokens from position 0 through the model and its LM
        head's last row, writing its KV into ``tables`` (blocks the caller holds and frees), and
        sample that row greedily and at a temperature (top-p): the kernels a real prompt of this
        length reaches, and the sampler's, compile and autotune now. The token ids are spread
        over the vocabulary, so a MoE routes them as it would text."""
        model = cast(Any, self.model)
        ids = (np.arange(num_tokens, dtype=np.int64) * 7919 + 11) % int(model.vocab_size)
        chunk = ScheduledRequest(request=cast(Request, None), num_computed_tokens=0, num_new_tokens=num_tokens,
                                 request_id="warmup", token_ids=ids.tolist(), prefill=True)
        ctx, input_ids = self._context(build_host_batch([chunk], {"warmup": tables}, self.specs))
        logits = model.compute_logits(model(input_ids, ctx)[-1:])
        for params in WARMUP_SAMPLING:
            self.sampler(logits, [SamplingRow(params, [], [], ())])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run the step and sample the rows each sampling chunk names (``ScheduledRequest.sampling``:
        the request, and the other samples that draw their first token from the same logits row,
        each with its own seed and sample index)."""
        hidden, sample_rows = self.forward(sched)
        if self.drafter is not None:  # the chunks' hidden states feed the draft head (and its KV)
            self.drafter.observe(sched.scheduled, sched.block_tables, hidden)
        out = RunnerOutput()
        verified = 0
        for s in sched.scheduled:
            if s.draft_token_ids:
                out.verify_slots[s.request_id] = verified
                verified += s.num_new_tokens
        if not sample_rows:
            return out
        rows: list[tuple[int, str, SamplingRow, bool]] = []  # (hidden row, request id, sampling, verified)
        for row, s in sample_rows:
            k = len(s.draft_token_ids)
            if k:  # a verify step: the target's token at each of the last k + 1 positions
                rows += [(row - k + j, rid, srow, True) for j, (rid, srow) in enumerate(s.sampling)]
            else:
                rows += [(row, rid, srow, False) for rid, srow in s.sampling]
        logits = self.model.compute_logits(self._sampled_hidden(hidden, [r[0] for r in rows]))  # [N, V]
        tokens, logprobs = self.sampler(logits, [r[2] for r in rows])
        for (_, rid, _, verified), token, lp in zip(rows, tokens, logprobs):
            if verified:
                out.verified.setdefault(rid, []).append(token)
                out.verified_logprobs.setdefault(rid, []).append(lp)
            else:
                out.sampled[rid] = token
                out.logprobs[rid] = lp
        return out

    @torch.inference_mode()
    def propose(self, jobs: list[DraftJob], block_tables: dict[str, list[list[int]]]) -> dict[str, list[int]]:
        """Draft tokens with the draft head for a step whose slots are allocated."""
        assert self.drafter is not None
        return self.drafter.propose(jobs, block_tables)

    def can_launch(self, sched: SchedulerOutput) -> bool:
        """Whether ``launch`` can run this step: every request decodes one token and samples it
        (alone), within the captured graphs."""
        limit = self.graphs.max_batch if self.graphs is not None else len(sched.scheduled)
        return (0 < len(sched.scheduled) <= limit
                and all(s.num_new_tokens == 1 and len(s.sampling) == 1 for s in sched.scheduled))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, token_rows: dict[str, int], previous: torch.Tensor | None) -> torch.Tensor:
        """Run a decode step (``can_launch``) as a graph and sample, without waiting for the GPU:
        returns the sampled tokens ``[B]`` on the device. A request in ``token_rows`` takes its
        input token from ``previous[token_rows[id]]`` (sampled by the step still in flight)."""
        batch = build_host_batch(sched.scheduled, sched.block_tables, self.specs)
        source = None
        if token_rows and previous is not None:
            rows = np.array([token_rows.get(s.request_id, -1) for s in sched.scheduled], dtype=np.int64)
            source = (rows, previous)
        if self.graphs is not None:
            self.num_graph_steps += 1
            hidden = self.graphs.run(batch, source)
        else:  # eager (CPU, or graphs off): same bookkeeping, nothing to overlap
            self.num_eager_steps += 1
            ctx, input_ids = self._context(batch)
            if source is not None:
                input_ids = take_pending_tokens(input_ids, torch.from_numpy(source[0]).to(self.device), source[1])
            hidden = self.model(input_ids, ctx)
        logits = self.model.compute_logits(hidden)  # decode-only: row i is sequence i
        return self.sampler.sample_tokens(logits, [s.sampling[0][1] for s in sched.scheduled])

    def enable_verify_states(self, max_verified: int) -> None:
        """Verify steps for a model with ``state`` KV groups: each verified position's state goes
        to a row of its own (``max_verified``: the most verified positions a step has; one spare
        row), and ``commit_verified`` keeps the accepted one's."""
        self.verify_states = [torch.zeros((max_verified + 1, spec.num_layers, *spec.block_shape), dtype=cache.dtype,
                                          device=self.device) if spec.kind == "state" else None
                              for spec, cache in zip(self.specs, self.kv_caches)]

    @torch.inference_mode()
    def commit_verified(self, slots: list[int], tables: list[list[list[int]]], positions: list[int]) -> None:
        """After a verify step: the state after an accepted position ``positions[i]`` (the step's
        verified position ``slots[i]``) goes to the block of the request's ``state`` groups
        (``tables[i]``, per group) that holds that position's checkpoint. Given the request's
        newest accepted position and every accepted position that ends a block (as a prefill
        chunk checkpoints), the state groups are exactly those of a request that never saw its
        rejected drafts, prefix-cached blocks included."""
        if self.verify_states is None or not slots:
            return
        src = to_device(slots, torch.long, self.device)
        for g, (spec, scratch) in enumerate(zip(self.specs, self.verify_states)):
            if scratch is not None:
                dst = to_device([t[g][p // spec.block_size] for t, p in zip(tables, positions)], torch.long, self.device)
                self.kv_caches[g].index_copy_(0, dst, scratch.index_select(0, src))

    def can_launch_verify(self, num_requests: int, num_tokens: int) -> bool:
        """Whether ``launch_verify`` can run ``num_requests`` requests verifying ``num_tokens``
        drafts each: the decode and draft graphs are captured and hold them (and, for a model
        with ``state`` groups, the verified positions' scratch rows)."""
        drafter = self.drafter
        return (self.graphs is not None and drafter is not None and drafter.graphs is not None
                and drafter.graphs.k == num_tokens and 0 < num_requests <= drafter.graphs.max_batch
                and num_requests * (1 + num_tokens) <= self.graphs.verify_rows_limit)

    def capture_verify_graphs(self, emulate: bool = False) -> GraphStatus:
        """Capture greedy verify steps (``VerifyGraphs``) once the decode and draft graphs are; a
        capture or self-check that fails leaves them launched eagerly, and the returned status
        (also ``verify_graph_status``) says why."""
        drafter = self.drafter
        if self.graphs is None or drafter is None or drafter.graphs is None:
            self.verify_graph_status = GraphStatus(reason="needs the decode and draft-head CUDA graphs")
            return self.verify_graph_status
        try:
            graphs = VerifyGraphs(self.graphs, drafter.graphs, self.model, int(self.model.vocab_size), emulate=emulate)
        except GraphUnsafeError as exc:
            self.verify_graph_status = GraphStatus(reason=str(exc))
            return self.verify_graph_status
        self.verify_graph_status = capture_with_status(graphs, self.device, "verify-step",
                                                       "pipelined verify steps launch their kernels eagerly")
        if self.verify_graph_status.captured:
            self.verify_graphs = graphs
        return self.verify_graph_status

    @torch.inference_mode()
    def launch_verify(self, tables: Sequence[np.ndarray], rows: list[SamplingRow], inputs: torch.Tensor,
                      base: torch.Tensor, draw_scales: list[float] | None = None,
                      seeded: SeededWindow | None = None,
                      noise: Sequence[torch.Tensor | None] | torch.Tensor | None = None) -> VerifyLaunch:
        """A verify step of ``n`` requests (``can_launch_verify``; see ``verify_on_device``),
        without waiting for the GPU: greedy batches replay one verify-step graph, batches with
        sampled requests (no filters) the sampled one (``VerifyGraphs.run_sampled``), others
        replay the decode and draft graphs with their sampling and acceptance launched between.
        ``tables``: per KV group, the requests' blocks ``[n, W_g]``, covering every position
        written; ``rows``: the rows' sampling, request by request. ``noise``: per
        request, the draw noise ``[k + 1, V]`` of its rows that its drafts were drawn with
        (coupled drafts; None: drawn at the draw). ``draw_scales`` (per request 1 / temperature,
        0 for greedy): the next step's noise is drawn here (unseeded) and the head's next drafts
        of the sampled requests are drawn with it (``next_noise``); ``seeded``: the seeded
        requests' rows draw, and their next drafts are drawn, with the noise of their positions,
        chosen on the device (where every sampled request is seeded, no unseeded noise is drawn)."""
        assert self.graphs is not None and self.drafter is not None and self.drafter.graphs is not None
        n, r = inputs.shape
        table = stage_tables(tables, self.device)
        drafts, graphs = self.drafter.graphs, self.verify_graphs
        drafts.neutral()  # the device's proposals are greedy
        if graphs is not None and graphs.can_run(n) and all(row.params.greedy for row in rows):
            self.num_verify_graph_steps += 1
            return self._launched(graphs.run(table, inputs, base), n, graph=True)
        next_noise = draws = window = None
        if seeded is not None:
            self.num_seeded_launches += 1
        if draw_scales is not None and drafts.draws:
            unseeded = any(s > 0 and not (seeded is not None and seeded.seeded[i]) for i, s in enumerate(draw_scales))
            if seeded is not None:
                scale, gumbel = self.drafter.draws_from_noise(seeded.noise, draw_scales)  # [L, n, V']
                window = (gumbel, seeded.offset + 1, seeded.mask)
                draws = (scale, gumbel[:drafts.k])  # the seeded rows' drafts pick theirs from the window
            if unseeded:
                next_noise = self.sampler.unseeded_noise((n, r))
                draws = self.drafter.draws_from_noise(next_noise[:, :-1], draw_scales)  # the bonus row drafts nothing
            self.num_noise_launches += 1
        plain = not any(row.needs_host_filters for row in rows)
        if graphs is not None and plain and graphs.can_run_sampled(n, window is not None):
            drafts.neutral(draws)
            out = graphs.run_sampled(table, inputs, base, *self._sampled_rows(rows, n, r, noise, seeded), window=window)
            self.num_verify_graph_steps += 1
            self.num_sampled_verify_graph_steps += 1
            return self._launched(out, n, next_noise, graph=True)
        if noise is not None:
            for i in range(n):
                if noise[i] is not None:
                    for j in range(r):
                        rows[i * r + j].noise = noise[i][j]
        if seeded is not None:
            verify_noise = seeded.verify_noise(r)
            for i in (i for i, s in enumerate(seeded.seeded) if s):
                for j in range(r):
                    rows[i * r + j].noise = verify_noise[i, j]
        out = verify_on_device(self.graphs, drafts, self.model, table, inputs, base,
                               lambda logits: self.sampler.sample_tokens(logits, rows), draws=draws, window=window)
        self.num_graph_steps += 1
        return self._launched(out, n, next_noise)

    def _launched(self, out: VerifyOutputs, n: int, next_noise: torch.Tensor | None = None,
                  graph: bool = False) -> VerifyLaunch:
        """A launched verify step of ``n`` requests, its tokens and accepted counts on their way
        to the host. ``graph``: ``out`` lives in a verify graph's buffers, whose next replay
        overwrites them: its last hidden states are copied out for the next draft."""
        assert self.drafter is not None
        if graph:
            out.last_hidden = out.last_hidden.clone()
        self.drafter.count_device_proposal(n)
        return VerifyLaunch(out, *fetch(torch.cat((out.targets.reshape(-1), out.accepted))), next_noise)

    def _sampled_rows(self, rows: list[SamplingRow], n: int, r: int,
                      noise: Sequence[torch.Tensor | None] | torch.Tensor | None,
                      seeded: SeededWindow | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A sampled verify graph's per-row inputs: ``temperature [n r]`` (0: greedy) and the draw
        noise ``[n r, V]``: each request's handed over (``noise``), its seeded window's
        (``seeded``), else drawn now from the engine's generator (greedy rows: ones, unused)."""
        temperature = to_device([0.0 if row.params.greedy else row.params.temperature for row in rows],
                                torch.float32, self.device)
        is_seeded = seeded.seeded if seeded is not None else [False] * n
        unseeded = [not rows[i * r].params.greedy and not is_seeded[i] for i in range(n)]
        if seeded is not None and not any(unseeded):  # the seeded rows' window alone (greedy rows: unused)
            return temperature, seeded.verify_noise(r).reshape(n * r, -1)
        if isinstance(noise, torch.Tensor):
            draw = noise
        elif noise is None:  # one draw for every row (greedy and seeded rows leave theirs unused)
            draw = self.sampler.unseeded_noise((n, r))
        else:
            draw = torch.ones((n, r, self.sampler.vocab_size), dtype=torch.float32, device=self.device)
            for i in range(n):
                if noise[i] is not None:
                    draw[i].copy_(noise[i][:r])
                elif unseeded[i]:
                    draw[i].copy_(self.sampler.unseeded_noise((r,)))
        if seeded is not None:
            draw = torch.where(seeded.mask[:, None, None], seeded.verify_noise(r), draw)
        return temperature, draw.reshape(n * r, -1)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[list[tuple[int, int]]]) -> None:
        """Copy whole KV blocks (every layer of the group), per group (source, destination) pairs."""
        for cache, pairs in zip(self.kv_caches, copies):
            if pairs:
                src = to_device([a for a, _ in pairs], torch.long, self.device)
                dst = to_device([b for _, b in pairs], torch.long, self.device)
                raw = cache.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[cache.element_size()])
                raw.index_copy_(0, dst, raw.index_select(0, src))  # as integers: fp8 has no index_copy

    def _sampled_hidden(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if rows == list(range(hidden.shape[0])):  # decode-only: every row, in order
            return hidden
        return hidden.index_select(0, to_device(rows, torch.long, self.device))

    def _context(self, batch: HostBatch) -> tuple[ForwardContext, torch.Tensor]:
        dev = self.device

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)
        ctx = ForwardContext(
            positions=to_dev(batch.positions), query_start_loc=to_dev(batch.query_start_loc),
            seq_lens=to_dev(batch.seq_lens), query_start_loc_cpu=batch.query_start_loc.tolist(),
            seq_lens_cpu=batch.seq_lens.tolist(), kv_caches=self.kv_caches,
            block_tables=[to_dev(t) for t in batch.block_tables],
            slot_mappings=[None if s is None else to_dev(s) for s in batch.slot_mappings],
            block_sizes=[s.block_size for s in self.specs], prefill=batch.prefill)
        if batch.verify_slot is not None and self.verify_states is not None:
            assert batch.verify_prev is not None
            ctx.verify_slot, ctx.verify_prev = to_dev(batch.verify_slot), to_dev(batch.verify_prev)
            ctx.verify_slot_cpu, ctx.verify_prev_cpu = batch.verify_slot.tolist(), batch.verify_prev.tolist()
            ctx.verify_depth, ctx.verify_states = batch.verify_depth, self.verify_states
        return ctx, to_dev(batch.input_ids)


def plan_num_blocks(specs: list[KVGroupSpec], memory_bytes: int, max_num_seqs: int,
                    max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """Split a KV memory budget across groups. Window and state groups only ever hold a bounded
    number of blocks per request, so they get what ``max_num_seqs`` requests (plus one step's chunk,
    doubled for prefix-cache headroom) need; the rest is shared by full and compressed groups in
    proportion to the bytes each needs per token, so they run out at the same context length."""
    bounded = {}
    for g, spec in enumerate(specs):
        if spec.kind in ("sliding_window", "state"):
            window = spec.sliding_window or 1
            per_seq = math.ceil(window / spec.block_size) + 2
            chunk = math.ceil(max_num_batched_tokens / spec.block_size) + 1
            bounded[g] = 2 * (max_num_seqs * per_seq + chunk) + 1
    used = sum(bounded[g] * specs[g].bytes_per_block for g in bounded)
    growing = [g for g in range(len(specs)) if g not in bounded]
    per_token = sum(specs[g].bytes_per_block / specs[g].tokens_per_block for g in growing)
    tokens = max(0, memory_bytes - used) / per_token if per_token else 0
    counts = []
    for g, spec in enumerate(specs):
        counts.append(bounded[g] if g in bounded else int(tokens // spec.tokens_per_block) + 1)
    return counts
