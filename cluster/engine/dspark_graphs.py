"""DSparkGraphs: a DSpark proposal (one block per request through the drafter's stages, the
shared LM head and the Markov head row by row: ``DSparkDrafter.draft_block``) replayed as one
captured CUDA graph per padded batch size.

Eagerly, a block is a few hundred small kernels launched from Python (three V4 blocks with their
hyper-connections and MoE, the heads, ``B`` Markov rows): on a GPU that costs ten times the verify
step it feeds. In a graph it is one launch.

Inputs (static buffers, filled from one pinned host buffer with one copy): each request's newest
token ``anchors [S]``, its position ``positions [S]`` and its ``swa`` block table ``tables [S, W]``.
A block reads the stages' context entries below its position and writes nothing (its own rows'
entries stay in registers), so padding requests (anchor 0, position 0, a table of null blocks)
need no care. Outputs: the drafts ``[S, B]`` and their confidence logits ``[S, B]``.
``emulate=True`` (CPU tests): no capture; each replay runs the block on the static buffers under
:class:`GraphSafetyCheck`, as DecodeGraphs does.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from cluster.engine.batch import pad_tables
from cluster.engine.cuda_graphs import EmulatedGraph, GraphUnsafeError, warm_and_capture, graph_batch_sizes, stage

if TYPE_CHECKING:
    from cluster.engine.dspark_runner import DSparkRunner

logger = logging.getLogger(__name__)


class DSparkGraphs:
    def __init__(self, runner: "DSparkRunner", max_batch: int, table_width: int, max_model_len: int,
                 emulate: bool = False) -> None:
        self.runner = runner
        self.emulate = emulate
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = b = self.sizes[-1]
        self.width = runner.drafter.spec.block_size
        with torch.device(runner.device):
            self.anchors = torch.zeros(b, dtype=torch.int64)
            self.positions = torch.zeros(b, dtype=torch.int64)
            self.tables = torch.zeros((b, table_width), dtype=torch.int32)
        self.graphs: dict[int, Any] = {}
        #: Per size: (drafts [size, B] int64, confidence logits [size, B] float32).
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.timings: dict[str, float] = {}
        self.verified_size = 0

    def forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks of the first ``size`` requests' buffers (what a graph of ``size`` holds)."""
        r = self.runner
        model = r.model
        drafts, _, confidence = r.drafter.draft_block(model.embed, model.head_logits, model.rope, r.kv_caches,
                                                      self.tables[:size], self.anchors[:size], self.positions[:size])
        return drafts, confidence

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every size up eagerly (compilation, autotuning and the Markov head's float32 copy
        stay outside the graphs), capture from the largest size down in one memory pool, then
        ``verify``."""
        self._clear()
        if self.emulate:
            self.graphs = {size: EmulatedGraph(self, size) for size in self.sizes}
            self.verified_size = self.verify()
            return
        self.graphs, = warm_and_capture([(self.forward, self.outputs)], self.sizes, self.runner.device,
                                        self.timings, "dspark_")
        self.verified_size = self.verify()
        logger.info("captured DSpark block CUDA graphs for batch sizes %s (batch %d verified against the eager "
                    "block)", self.sizes, self.verified_size)

    def _clear(self) -> None:
        self.anchors.zero_()
        self.positions.zero_()
        self.tables.zero_()

    @torch.inference_mode()
    def verify(self) -> int:
        """Replay the largest graph on inputs it was not captured with (random anchors, positions
        and tables: blocks only read the cache) and compare with the same block drafted eagerly:
        a graph that froze a value at capture drafts other tokens. Raises GraphUnsafeError (the
        blocks are then drafted eagerly)."""
        size = self.sizes[-1]
        r = self.runner
        dev = r.device
        gen = torch.Generator(device=dev).manual_seed(0)
        blocks = int(r.kv_caches[r.drafter.layers[0][0]].shape[0])
        self.anchors[:size].copy_(torch.randint(0, int(r.drafter.args.vocab_size), (size,), generator=gen, device=dev))
        self.positions[:size].copy_(torch.randint(0, max(1, self.max_model_len - self.width), (size,),
                                                  generator=gen, device=dev))
        self.tables[:size].copy_(torch.randint(0, blocks, (size, self.tables.shape[1]), generator=gen, device=dev))
        try:
            want, want_conf = self.forward(size)
            self.graphs[size].replay()
            got, got_conf = self.outputs[size]
            agree = float((got == want).float().mean())
            error = float((got_conf - want_conf).abs().max())
            scale = float(want_conf.abs().max())
        finally:
            self._clear()
        # float rounding may flip a near-tie; a frozen input changes nearly every draft
        if agree < 0.9 or not error <= 0.05 * max(scale, 1e-6) + 1e-3:
            raise GraphUnsafeError(f"DSpark block graph of batch {size} replayed other drafts than the eager block "
                                   f"({agree:.0%} agree, confidence off by {error:.3g} at scale {scale:.3g})")
        return size

    def can_run(self, tables: Sequence[Sequence[int]]) -> bool:
        """Whether these requests' blocks (their ``swa`` tables) fit a captured graph."""
        return (bool(self.graphs) and 0 < len(tables) <= self.max_batch
                and all(len(t) <= self.tables.shape[1] for t in tables))

    @torch.inference_mode()
    def run(self, tables: Sequence[Sequence[int]], anchors: Sequence[int], positions: Sequence[int]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts ``[n, B]`` and confidence logits ``[n, B]`` on the device for ``n`` requests
        (``can_run``), without waiting for the GPU."""
        n = len(tables)
        size = next(s for s in self.sizes if s >= n)
        width = self.tables.shape[1]
        host = np.zeros(2 * size + size * width, dtype=np.int64)
        host[:n] = anchors
        host[size:size + n] = positions
        pad_tables(tables, host[2 * size:].reshape(size, width))
        staged = stage(host, self.runner.device)
        self.anchors[:size].copy_(staged[:size])
        self.positions[:size].copy_(staged[size:2 * size])
        self.tables[:size].copy_(staged[2 * size:].view(size, width))
        self.graphs[size].replay()
        drafts, confidence = self.outputs[size]
        return drafts[:n], confidence[:n]
