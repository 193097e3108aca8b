"""A pipelined verify step's device work (spec_pipeline.py): the verify rows through the model,
each row's token, the drafts accepted, and the draft head's next proposal, with no host value.

``verify_on_device`` runs it on the decode graphs' and the draft graphs' buffers: replaying those
two graphs with eager work between them (``replay=True``; rows sampled by the engine's sampler,
any sampling), or running their forwards inside another capture (``replay=False``).
``VerifyGraphs`` captures that whole step, greedy, as one CUDA graph per batch size: a step is
then one replay and a few copies instead of about a hundred launches from Python, which on a small
model cost more host time than the GPU spends on the step. Requests beyond the batch (padding up
to the graph's size) read the null block and write nowhere. ``emulate=True`` (CPU tests): no
capture; each replay runs the forward on the static buffers under :class:`GraphSafetyCheck`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cluster.engine.cuda_graphs import DecodeGraphs, EmulatedGraph, GraphUnsafeError, capture_sizes
from cluster.engine.draft_graphs import DraftHeadGraphs

logger = logging.getLogger(__name__)


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


def verify_on_device(decode: DecodeGraphs, drafts: DraftHeadGraphs, model: Any, table: torch.Tensor,
                     inputs: torch.Tensor, base: torch.Tensor, sample: Callable[[torch.Tensor], torch.Tensor],
                     live: torch.Tensor | None = None, replay: bool = True,
                     draws: tuple[torch.Tensor, torch.Tensor] | None = None,
                     window: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> VerifyOutputs:
    """A verify step of ``n`` requests: ``inputs [n, k + 1]`` (each one's last known token, then
    its drafts) at positions ``base [n]`` on, one decode row each, over ``table [n, W]`` (their
    blocks, covering every position written); ``sample`` turns the rows' logits into tokens; the
    drafts are accepted while they equal the target's tokens, then the head drafts ``k`` more
    (sampled requests drawing theirs with ``draws``: ``DraftHeadRunner.draws_from_noise``; the
    seeded ones with their positions' noise from ``window``, see ``run_after_verify``)."""
    n, r = inputs.shape
    hidden = decode.run_on_device(inputs, base, table, live=live, replay=replay)  # [n * r, H]
    targets = sample(model.compute_logits(hidden)).view(n, r)
    proposal, accepted, token = drafts.run_after_verify(table, base, inputs, targets, hidden, live=live, replay=replay,
                                                        draws=draws, window=window)
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
        self.sizes = [s for s in drafts.sizes if s * self.rows <= decode.max_batch]
        if not self.sizes:
            raise GraphUnsafeError(f"the decode graphs ({decode.max_batch} rows) hold no verify step of "
                                   f"{self.rows} rows")
        self.max_batch = b = self.sizes[-1]
        with torch.device(decode.device):
            self.inputs = torch.zeros((b, self.rows), dtype=torch.int64)
            self.base = torch.zeros(b, dtype=torch.int64)
            self.tables = torch.zeros((b, decode.block_tables[0].shape[1]), dtype=torch.int32)
            self.live = torch.zeros(b, dtype=torch.bool)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, VerifyOutputs] = {}
        self.timings: dict[str, float] = {}
        self.verified_size = 0

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, :self.vocab_size].argmax(dim=-1)

    def forward(self, size: int) -> VerifyOutputs:
        return verify_on_device(self.decode, self.drafts, self.model, self.tables[:size], self.inputs[:size],
                                self.base[:size], self._greedy, live=self.live[:size], replay=False)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every size up eagerly (no request live: nothing written), capture from the largest
        size down in one memory pool, then ``verify``."""
        self.live.zero_()
        if self.emulate:
            self.graphs = {size: EmulatedGraph(self, size) for size in self.sizes}
            self.verified_size = self.verify()
            return
        dev = self.decode.device
        start = time.perf_counter()
        for size in self.sizes:
            self.forward(size)
        torch.cuda.synchronize(dev)
        self.timings["verify_warmup_s"] = time.perf_counter() - start
        start = time.perf_counter()
        self.graphs = capture_sizes(self.forward, self.sizes, self.outputs)  # type: ignore[arg-type]
        torch.cuda.synchronize(dev)
        self.timings["verify_capture_s"] = time.perf_counter() - start
        self.verified_size = self.verify()
        logger.info("captured verify-step CUDA graphs for batch sizes %s (batch %d verified against the eager "
                    "step)", self.sizes, self.verified_size)

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
        self.base.copy_(torch.randint(0, 64, self.base.shape, generator=gen, device=dev))
        self.live.zero_()
        try:
            expected = self.forward(size)
            want = [expected.targets.clone(), expected.next_inputs.clone(), expected.next_base.clone()]
            self.graphs[size].replay()
            got = self.outputs[size]
            agree = [float((g == w).float().mean()) for g, w in zip((got.targets, got.next_inputs, got.next_base), want)]
        finally:
            self.inputs.zero_()
            self.base.zero_()
        # float rounding may flip a near-tie; a frozen input changes nearly every token
        if min(agree) < 0.9:
            raise GraphUnsafeError(f"verify-step graph of batch {size} replayed other tokens than the eager step "
                                   f"(agreement {min(agree):.0%})")
        return size

    def can_run(self, n: int) -> bool:
        return bool(self.graphs) and 0 < n <= self.max_batch

    @torch.inference_mode()
    def run(self, table: torch.Tensor, inputs: torch.Tensor, base: torch.Tensor) -> VerifyOutputs:
        """A greedy verify step of ``n`` requests (see ``verify_on_device``) as one replay; the
        outputs are the graph's buffers, valid until its next replay."""
        n = inputs.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.inputs[:n].copy_(inputs)
        self.inputs[n:size].zero_()
        self.base[:n].copy_(base)
        self.base[n:size].zero_()
        self.tables[:size].zero_()
        self.tables[:n, :table.shape[1]].copy_(table)
        self.live[:n].fill_(True)
        self.live[n:size].fill_(False)
        self.graphs[size].replay()
        return self.outputs[size].head(n)
