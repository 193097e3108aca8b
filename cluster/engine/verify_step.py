"""A pipelined verify step's device work (spec_pipeline.py): the verify rows through the model,
each row's token, the drafts accepted, and the draft head's next proposal, with no host value.

``verify_on_device`` runs it on the decode graphs' and the draft graphs' buffers: replaying those
two graphs with eager work between them (``replay=True``; rows sampled by the engine's sampler,
any sampling), or running their forwards inside another capture (``replay=False``).
``VerifyGraphs`` captures that whole step as one CUDA graph per batch size: a step is then one
replay and a few copies instead of about a hundred launches from Python, which on a small model
cost more host time than the GPU spends on the step. Greedy batches replay the greedy graphs;
batches with sampled requests (temperature only: no top-k, top-p or min-p) replay the sampled
graphs, which draw each row as the sampler does (``softmax(logits / T)`` raced against the row's
exponential noise, the greedy rows' argmax kept) from per-row temperature and noise buffers filled
before the replay, and pick the seeded requests' next-draft noise by the accepted drafts inside
the capture (``run_after_verify``'s window). Requests beyond the batch (padding up to the graph's
size) read the null block and write nowhere. ``emulate=True`` (CPU tests): no
capture; each replay runs the forward on the static buffers under :class:`GraphSafetyCheck`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cluster.engine.cuda_graphs import DecodeGraphs, EmulatedGraph, GraphSafetyCheck, GraphUnsafeError, warm_and_capture
from cluster.engine.draft_graphs import DraftHeadGraphs
from kernels.sampling import sample_with_noise_ref

logger = logging.getLogger(__name__)

#: The most memory the sampled graphs' noise buffers may take (the rows' draw noise ``[batch (k +
#: 1), V]`` and the seeded requests' next-draft noise window ``[flight_reach(k), batch, V']``,
#: float32); beyond it sampled batches (or their seeded requests' windows) launch eagerly, said at
#: start-up.
MAX_SAMPLED_BUFFER_BYTES = 256 << 20


def flight_reach(k: int) -> int:
    """How far past a request's computed tokens the two verify steps in flight may write (a step
    accepting all ``k`` drafts, then the next step's verify rows and its head's chained passes),
    and so the output positions a seeded window covers (``SeededWindow``, spec_pipeline.py)."""
    return 3 * k + 2


@dataclass
class VerifyOutputs:
    #: ``[n, k + 1]`` the target's token at each verified position; ``[n]`` drafts accepted.
    targets: torch.Tensor
    accepted: torch.Tensor
    #: The next verify step's input tokens ``[n, k + 1]`` (the target's token after the
    #: accepted drafts, then the head's ``k`` drafts) and first positions ``[n]``.
    next_inputs: torch.Tensor
    next_base: torch.Tensor
    #: ``[n, H]`` the target's hidden state at ``next_base - 1``.
    last_hidden: torch.Tensor

    def head(self, n: int) -> "VerifyOutputs":
        """The first ``n`` requests' rows."""
        return VerifyOutputs(self.targets[:n], self.accepted[:n], self.next_inputs[:n], self.next_base[:n],
                             self.last_hidden[:n])


def verify_on_device(decode: DecodeGraphs, drafts: DraftHeadGraphs, model: Any, tables: Sequence[torch.Tensor],
                     inputs: torch.Tensor, base: torch.Tensor, sample: Callable[[torch.Tensor], torch.Tensor],
                     live: torch.Tensor | None = None, replay: bool = True,
                     draws: tuple[torch.Tensor, torch.Tensor] | None = None,
                     window: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> VerifyOutputs:
    """A verify step of ``n`` requests: ``inputs [n, k + 1]`` (each one's last known token, then
    its drafts) at positions ``base [n]`` on, one decode row each, over ``tables`` (per KV group
    ``[n, W_g]``: their blocks, covering every position written); ``sample`` turns the rows' logits
    into tokens; the drafts are accepted while they equal the target's tokens, then the head (the
    draft head, or the MTP layer: its KV in the first group) drafts ``k`` more (sampled requests
    drawing theirs with ``draws``: ``DraftHeadRunner.draws_from_noise``; the seeded ones with their
    positions' noise from ``window``, see ``run_after_verify``). A model with ``state`` groups
    (DeepSeek-V4's compressors) then keeps the accepted positions' states
    (``DecodeGraphs.commit_states``)."""
    n, r = inputs.shape
    hidden = decode.run_on_device(inputs, base, tables, live=live, replay=replay)  # [n * r, H]
    targets = sample(model.compute_logits(hidden)).view(n, r)
    proposal, accepted, token = drafts.run_after_verify(tables[0], base, inputs, targets, hidden, live=live,
                                                        replay=replay, draws=draws, window=window)
    decode.commit_states(tables, base, accepted, live, r)
    last_hidden = hidden.index_select(0, drafts.last_rows[:n])  # each request's row at its newest position
    return VerifyOutputs(targets, accepted, torch.cat((token[:, None], proposal), dim=1), base + accepted + 1,
                         last_hidden)


class VerifyGraphs:
    def __init__(self, decode: DecodeGraphs, drafts: DraftHeadGraphs, model: Any, vocab_size: int,
                 emulate: bool = False) -> None:
        self.decode, self.drafts, self.model = decode, drafts, model
        self.vocab_size = vocab_size
        self.emulate = emulate
        self.rows = drafts.k + 1
        self.sizes = [s for s in drafts.sizes if s * self.rows <= decode.verify_rows_limit]
        if not self.sizes:
            raise GraphUnsafeError(f"the decode graphs ({decode.verify_rows_limit} verify rows) hold no verify step "
                                   f"of {self.rows} rows")
        self.max_batch = b = self.sizes[-1]
        with torch.device(decode.device):
            self.inputs = torch.zeros((b, self.rows), dtype=torch.int64)
            self.base = torch.zeros(b, dtype=torch.int64)
            #: Per KV group, the requests' block tables.
            self.tables = [torch.zeros((b, t.shape[1]), dtype=torch.int32) for t in decode.block_tables]
            self.live = torch.zeros(b, dtype=torch.bool)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, VerifyOutputs] = {}
        self.timings: dict[str, float] = {}
        self.verified_size = 0
        # sampled steps: per-row temperature (0: greedy) and draw noise; the seeded requests'
        # next-draft noise window (``run_after_verify``) where the draft graphs draw
        rows = b * self.rows
        width = drafts.drafter.draft_width
        #: Positions a seeded window covers (see spec_pipeline.py: how far two steps in flight reach).
        self.window_length = flight_reach(drafts.k)
        noise_bytes = rows * vocab_size * 4
        window_bytes = self.window_length * b * width * 4 if drafts.draws else 0
        #: Whether batches with sampled requests replay a graph (``sampled``), seeded ones with
        #: coupled drafts too (``windows``), and why not.
        self.sampled = noise_bytes <= MAX_SAMPLED_BUFFER_BYTES
        self.windows = self.sampled and drafts.draws and noise_bytes + window_bytes <= MAX_SAMPLED_BUFFER_BYTES
        self.sampled_reason = "" if self.sampled else (
            f"batches with sampled requests launch eagerly: the draw noise buffer would take {noise_bytes >> 20} MiB "
            f"(at most {MAX_SAMPLED_BUFFER_BYTES >> 20} MiB)")
        if self.sampled and not self.windows:
            self.sampled_reason = ("batches with seeded requests and coupled drafts launch eagerly: "
                                   + (drafts.draws_reason if not drafts.draws else
                                      f"the noise windows would take {(noise_bytes + window_bytes) >> 20} MiB "
                                      f"(at most {MAX_SAMPLED_BUFFER_BYTES >> 20} MiB)"))
        with torch.device(decode.device):
            self.temperature = torch.zeros(rows if self.sampled else 0, dtype=torch.float32)
            self.noise = torch.ones((rows, vocab_size) if self.sampled else (0,), dtype=torch.float32)
            self.window_gumbel = torch.zeros((self.window_length, b, width) if self.windows else (0,),
                                             dtype=torch.float32)
            self.window_start = torch.zeros(b if self.windows else 0, dtype=torch.int64)
            self.window_rows = torch.zeros(b if self.windows else 0, dtype=torch.bool)
        self.sampled_graphs: dict[int, Any] = {}
        self.sampled_outputs: dict[int, VerifyOutputs] = {}

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, :self.vocab_size].argmax(dim=-1)

    def _draw(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's token as ``Sampler`` draws it without filters or penalties: the argmax for a
        greedy row (temperature 0), else ``argmax(softmax(logits / T) / E)`` with the row's noise."""
        logits = logits[:, :self.vocab_size].float()
        m = logits.shape[0]
        temperature = self.temperature[:m]
        sampled = temperature > 0
        probs = (logits / torch.where(sampled, temperature, 1.0)[:, None]).softmax(-1)
        return torch.where(sampled, sample_with_noise_ref(probs, self.noise[:m]), logits.argmax(-1))

    def forward(self, size: int) -> VerifyOutputs:
        return verify_on_device(self.decode, self.drafts, self.model, [t[:size] for t in self.tables],
                                self.inputs[:size], self.base[:size], self._greedy, live=self.live[:size],
                                replay=False)

    def sampled_forward(self, size: int) -> VerifyOutputs:
        window = None
        if self.windows:
            window = (self.window_gumbel[:, :size], self.window_start[:size], self.window_rows[:size])
        return verify_on_device(self.decode, self.drafts, self.model, [t[:size] for t in self.tables],
                                self.inputs[:size], self.base[:size], self._draw, live=self.live[:size],
                                replay=False, window=window)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every size up eagerly (no request live: nothing written), capture from the largest
        size down in one memory pool, then ``verify``."""
        self.live.zero_()
        if self.emulate:
            self.graphs = {size: EmulatedGraph(self, size) for size in self.sizes}
            if self.sampled:
                self.sampled_graphs = {size: _EmulatedSampled(self, size) for size in self.sizes}
            self.verified_size = self.verify()
            return
        forwards: list[tuple[Callable[[int], Any], dict[int, Any]]] = [(self.forward, self.outputs)]
        if self.sampled:
            forwards.append((self.sampled_forward, self.sampled_outputs))
        graphs = warm_and_capture(forwards, self.sizes, self.decode.device, self.timings, "verify_")
        self.graphs = graphs[0]
        if self.sampled:
            self.sampled_graphs = graphs[1]
        self.verified_size = self.verify()
        logger.info("captured verify-step CUDA graphs for batch sizes %s, greedy%s (batch %d verified against the "
                    "eager step)", self.sizes, " and sampled" if self.sampled else "", self.verified_size)
        if self.sampled_reason:
            logger.warning("verify-step CUDA graphs: %s", self.sampled_reason)

    @torch.inference_mode()
    def verify(self) -> int:
        """Replay the largest graph on inputs it was not captured with (random tokens and
        positions; no request live, so nothing is written) and compare with the same step run
        eagerly: a graph that froze a value at capture gives other tokens. Raises
        GraphUnsafeError (verify steps then launch their kernels eagerly)."""
        size = self.sizes[-1]
        dev = self.decode.device
        gen = torch.Generator(device=dev).manual_seed(0)
        self.inputs.copy_(torch.randint(0, self.vocab_size, self.inputs.shape, generator=gen, device=dev))
        self.live.zero_()
        # One KV group (the Llama family): no request live, nothing written, every row reads the
        # null block's unchanged bytes. Several (DeepSeek-V4): a step writes its state groups'
        # checkpoints and its compressed entries whatever the rows' liveness, into the null block
        # for padding rows, from every row at once (on a GPU, whichever row lands last wins), and
        # reads them back in the same step; so there each request gets blocks of its own in every
        # group, live, and those blocks' bytes are put back before each run and after.
        private = self._private_blocks(size, gen) if len(self.tables) > 1 else None
        if private is None:
            self.base.copy_(torch.randint(0, 64, self.base.shape, generator=gen, device=dev))

        def restore() -> None:
            if private is not None:
                for cache, before in zip(self.decode.kv_caches, private):
                    cache[1:1 + before.shape[0]].copy_(before)
        checks = [("greedy", self.forward, self.graphs, self.outputs)]
        if self.sampled:
            # half the rows sampled at random temperatures and noise; coupled next drafts with
            # random window noise picked by the accepted drafts (the draft graphs' buffers)
            m = size * self.rows
            self.temperature[:m].copy_(torch.where(torch.rand(m, generator=gen, device=dev) < 0.5, 0.0,
                                                   0.5 + torch.rand(m, generator=gen, device=dev)))
            self.noise[:m].exponential_(generator=gen)
            if self.windows:
                self.drafts.scale[:size].copy_(0.5 + torch.rand(size, generator=gen, device=dev))
                self.window_gumbel[:, :size].exponential_(generator=gen).log_().neg_()
                self.window_start[:size].copy_(torch.randint(0, self.drafts.k + 2, (size,), generator=gen, device=dev))
                self.window_rows[:size].copy_(torch.rand(size, generator=gen, device=dev) < 0.5)
            checks.append(("sampled", self.sampled_forward, self.sampled_graphs, self.sampled_outputs))
        try:
            for kind, forward, graphs, outputs in checks:
                restore()
                expected = forward(size)
                want = [expected.targets.clone(), expected.next_inputs.clone(), expected.next_base.clone()]
                restore()
                graphs[size].replay()
                got = outputs[size]
                agree = [float((g == w).float().mean()) for g, w in zip((got.targets, got.next_inputs, got.next_base),
                                                                       want)]
                # float rounding may flip a near-tie; a frozen input changes nearly every token
                if min(agree) < 0.9:
                    problem = (f"{kind} verify-step graph of batch {size} replayed other tokens than the eager step "
                               f"(agreement {min(agree):.0%})")
                    if kind == "greedy":
                        raise GraphUnsafeError(problem)
                    # the greedy graphs stand; sampled batches launch between the decode and draft graphs
                    self.sampled_graphs = {}
                    self.sampled_reason = f"batches with sampled requests launch eagerly: {problem}"
                    logger.warning("verify-step CUDA graphs: %s", self.sampled_reason)
        finally:
            restore()
            self.inputs.zero_()
            self.base.zero_()
            self.live.zero_()
            for table in self.tables:
                table.zero_()
            if self.sampled:
                self.temperature.zero_()
                self.noise.fill_(1.0)
            if self.windows:  # the draft graphs' draws back to greedy
                self.drafts.scale.fill_(1.0)
                self.drafts.gumbel.zero_()
                self.window_rows.zero_()
        return size

    def _private_blocks(self, size: int, gen: torch.Generator) -> list[torch.Tensor]:
        """For ``verify``: request ``i`` of ``size`` gets blocks ``1 + i B_g .. (i + 1) B_g`` of
        each group ``g`` (enough for its positions), live, at a random base position; returns the
        bytes of blocks ``1 ..`` that the step may write, to put back. The base positions reach as
        far as every group's free blocks and table width allow (up to 64)."""
        dev = self.decode.device
        r = self.rows
        limit = 64
        for spec, cache, table in zip(self.decode.specs, self.decode.kv_caches, self.tables):
            per_request = min((int(cache.shape[0]) - 1) // size, table.shape[1])
            limit = min(limit, per_request * spec.block_size - r + 1)
        if limit < 1:
            raise GraphUnsafeError(f"no KV blocks to verify a verify-step graph of batch {size} with (each of its "
                                   f"requests needs blocks of its own in every group)")
        self.base[:size].copy_(torch.randint(0, limit, (size,), generator=gen, device=dev))
        self.live[:size] = True
        saved = []
        for spec, cache, table in zip(self.decode.specs, self.decode.kv_caches, self.tables):
            blocks = (limit - 1 + r + spec.block_size - 1) // spec.block_size
            table.zero_()
            own = 1 + torch.arange(size * blocks, device=dev, dtype=table.dtype).view(size, blocks)
            table[:size, :blocks] = own
            saved.append(cache[1:1 + size * blocks].clone())
        return saved

    def can_run(self, n: int) -> bool:
        return bool(self.graphs) and 0 < n <= self.max_batch

    def can_run_sampled(self, n: int, window: bool) -> bool:
        """Whether ``run_sampled`` holds ``n`` requests (``window``: seeded ones drawing coupled
        drafts, whose noise the accepted drafts pick)."""
        return bool(self.sampled_graphs) and 0 < n <= self.max_batch and (self.windows or not window)

    @torch.inference_mode()
    def run(self, tables: Sequence[torch.Tensor], inputs: torch.Tensor, base: torch.Tensor) -> VerifyOutputs:
        """A greedy verify step of ``n`` requests (see ``verify_on_device``) as one replay; the
        outputs are the graph's buffers, valid until its next replay."""
        size = self._stage(tables, inputs, base)
        self.graphs[size].replay()
        return self.outputs[size].head(inputs.shape[0])

    @torch.inference_mode()
    def run_sampled(self, tables: Sequence[torch.Tensor], inputs: torch.Tensor, base: torch.Tensor,
                    temperature: torch.Tensor,
                    noise: torch.Tensor, window: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                    ) -> VerifyOutputs:
        """A verify step of ``n`` requests with sampled ones as one replay: ``temperature [n (k +
        1)]`` each row's (0: greedy), ``noise [n (k + 1), V]`` each sampled row's draw noise;
        the draft graphs' ``scale``/``gumbel`` already hold the next drafts' draws
        (``DraftHeadGraphs.neutral``); ``window`` (``gumbel [L, n, V']``, ``start [n]``, ``rows
        [n]``) the seeded requests' next-draft noise, picked on the device (``run_after_verify``).
        The outputs are the graph's buffers, valid until its next replay."""
        n = inputs.shape[0]
        m = n * self.rows
        size = self._stage(tables, inputs, base)
        self.temperature[:m].copy_(temperature)
        self.temperature[m:size * self.rows].zero_()
        self.noise[:m].copy_(noise)
        if self.windows:
            if window is None:
                self.window_rows[:size].zero_()
            else:
                gumbel, start, rows = window
                self.window_gumbel[:, :n].copy_(gumbel)
                self.window_start[:n].copy_(start)
                self.window_rows[:n].copy_(rows)
                self.window_rows[n:size].zero_()
        self.sampled_graphs[size].replay()
        return self.sampled_outputs[size].head(n)

    def _stage(self, tables: Sequence[torch.Tensor], inputs: torch.Tensor, base: torch.Tensor) -> int:
        """The step's inputs in the static buffers, padded to the graph's size (returned)."""
        n = inputs.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.inputs[:n].copy_(inputs)
        self.inputs[n:size].zero_()
        self.base[:n].copy_(base)
        self.base[n:size].zero_()
        for dest, table in zip(self.tables, tables, strict=True):
            dest[:size].zero_()
            dest[:n, :table.shape[1]].copy_(table)
        self.live[:n].fill_(True)
        self.live[n:size].fill_(False)
        return size


class _EmulatedSampled(EmulatedGraph):
    """The sampled graphs' stand-in on CPU (``EmulatedGraph`` for ``sampled_forward``)."""

    def replay(self) -> None:
        with GraphSafetyCheck():
            self.owner.sampled_outputs[self.size] = self.owner.sampled_forward(self.size)
