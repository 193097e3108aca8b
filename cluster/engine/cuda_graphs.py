"""DecodeGraphs: decode steps replayed as captured CUDA graphs.

One graph per padded batch size (1, 2, 4, 8, then every 16 up to ``max_batch``), all sharing one
memory pool and one set of static input buffers: token ids, positions, sequence lengths, query
starts, and per KV group the block tables and slot mappings. A step runs as a graph when every
scheduled request decodes one token and the batch fits the largest graph; the step's inputs are
copied into the buffers (padding rows write nowhere: slot -1, null blocks) and the graph replays.
Larger or mixed batches run eagerly. Graphs need kernels with no host synchronisation and no
shape that depends on the step (the Triton attention path); the model declares that with
``supports_cuda_graphs``."""
from __future__ import annotations

import logging

import torch

from cluster.common.kv_spec import KVGroupSpec
from cluster.engine.batch import HostBatch
from cluster.models.context import ForwardContext

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, specs: list[KVGroupSpec], kv_caches: list[torch.Tensor],
                 device: torch.device, max_batch: int, max_model_len: int) -> None:
        self.model = model
        self.specs = specs
        self.kv_caches = kv_caches
        self.device = device
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        b = self.max_batch
        with torch.device(device):
            self.input_ids = torch.zeros(b, dtype=torch.int64)
            self.positions = torch.zeros(b, dtype=torch.int64)
            self.seq_lens = torch.ones(b, dtype=torch.int32)
            self.query_start_loc = torch.arange(b + 1, dtype=torch.int32)
            self.block_tables = [torch.zeros((b, spec.blocks_needed(max_model_len)), dtype=torch.int32)
                                 for spec in specs]
            self.slot_mappings = [torch.full((b,), -1, dtype=torch.int64)
                                  if spec.kind in ("full", "sliding_window") else None for spec in specs]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _context(self, size: int) -> ForwardContext:
        return ForwardContext(
            positions=self.positions[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], query_start_loc_cpu=list(range(size + 1)),
            # The decode kernel sizes its split count from the longest possible context, so one
            # captured graph serves every context length.
            seq_lens_cpu=[self.max_model_len] * size, kv_caches=self.kv_caches,
            block_tables=[t[:size] for t in self.block_tables],
            slot_mappings=[s[:size] if s is not None else None for s in self.slot_mappings],
            block_sizes=[spec.block_size for spec in self.specs])

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every size up eagerly (compilation and autotuning stay outside the graphs), then
        capture from the largest size down, sharing one memory pool."""
        for size in self.sizes:
            self.model(self.input_ids[:size], self._context(size))
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(self.input_ids[:size], self._context(size))
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, batch: HostBatch) -> bool:
        return bool(self.graphs) and batch.decode_only and batch.num_seqs <= self.max_batch

    @torch.inference_mode()
    def run(self, batch: HostBatch) -> torch.Tensor:
        """Replay the smallest graph that holds the batch; returns hidden states ``[B, H]``."""
        n = batch.num_seqs
        size = next(s for s in self.sizes if s >= n)
        _fill(self.input_ids, batch.input_ids, size, 0)
        _fill(self.positions, batch.positions, size, 0)
        _fill(self.seq_lens, batch.seq_lens, size, 1)
        for g, table in enumerate(batch.block_tables):
            dest = self.block_tables[g]
            dest[:size].zero_()
            dest[:n, :table.shape[1]].copy_(torch.from_numpy(table), non_blocking=True)
            slots = batch.slot_mappings[g]
            target = self.slot_mappings[g]
            if slots is not None and target is not None:
                _fill(target, slots, size, -1)
        self.graphs[size].replay()
        return self.outputs[size][:n]


def _fill(dest: torch.Tensor, values: object, size: int, pad: int) -> None:
    import numpy as np
    host = torch.from_numpy(np.asarray(values)).to(dest.dtype)
    n = host.shape[0]
    dest[:n].copy_(host, non_blocking=True)
    if size > n:
        dest[n:size].fill_(pad)
