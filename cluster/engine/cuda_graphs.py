"""DecodeGraphs: decode steps replayed as captured CUDA graphs.

One graph per padded batch size (1, 2, 4, 8, then every 16 up to ``max_batch``), all sharing one
memory pool and one set of static input buffers: token ids, positions, sequence lengths, query
starts, and per KV group the block tables and slot mappings. A step runs as a graph when every
scheduled request decodes one token and the batch fits the largest graph; the step's inputs are
copied into the buffers (padding rows write nowhere: slot -1, null blocks) and the graph replays.
Larger or mixed batches run eagerly. Graphs need kernels with no host synchronisation and no
shape that depends on the step (the Triton attention path); the model declares that with
``supports_cuda_graphs``.

Filling the buffers never waits for the GPU: host values go through pinned memory (a copy from
pageable memory would synchronise), so the engine can prepare and launch step N+1 while step N
runs. A pipelined step's input tokens may still be on the device (sampled by the step in flight):
``run`` takes them from there (``token_source``)."""
from __future__ import annotations

import logging

import numpy as np
import torch

from cluster.common.kv_spec import KVGroupSpec
from cluster.engine.batch import HostBatch, take_pending_tokens
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
    def run(self, batch: HostBatch, token_source: tuple[np.ndarray, torch.Tensor] | None = None) -> torch.Tensor:
        """Replay the smallest graph that holds the batch; returns hidden states ``[B, H]``.
        ``token_source``: ``(rows, tokens)``: where ``rows[i] >= 0``, sequence ``i``'s input token
        is ``tokens[rows[i]]`` (a device tensor), not ``batch.input_ids[i]``."""
        n = batch.num_seqs
        size = next(s for s in self.sizes if s >= n)
        # Every per-sequence vector in one pinned host buffer, one copy to the device.
        columns = [(self.input_ids, batch.input_ids, 0), (self.positions, batch.positions, 0),
                   (self.seq_lens, batch.seq_lens, 1)]
        columns += [(target, slots, -1) for target, slots in zip(self.slot_mappings, batch.slot_mappings)
                    if target is not None and slots is not None]
        if token_source is not None:
            columns.append((None, token_source[0], -1))
        tables = [np.asarray(t, dtype=np.int64).reshape(-1) for t in batch.block_tables]
        host = np.empty(len(columns) * size + sum(t.size for t in tables), dtype=np.int64)
        for j, (_, values, pad) in enumerate(columns):
            host[j * size:j * size + n] = values
            host[j * size + n:(j + 1) * size] = pad
        offset = len(columns) * size
        for t in tables:
            host[offset:offset + t.size] = t
            offset += t.size
        staged = torch.from_numpy(host).pin_memory().to(self.device, non_blocking=True)
        for j, (target, _, _) in enumerate(columns):
            if target is not None:
                target[:size].copy_(staged[j * size:(j + 1) * size])
        offset = len(columns) * size
        for g, table in enumerate(batch.block_tables):
            dest = self.block_tables[g]
            dest[:size].zero_()
            dest[:n, :table.shape[1]].copy_(staged[offset:offset + table.size].view(table.shape))
            offset += table.size
        if token_source is not None:
            rows = staged[(len(columns) - 1) * size:len(columns) * size]
            self.input_ids[:size].copy_(take_pending_tokens(self.input_ids[:size], rows, token_source[1]))
        self.graphs[size].replay()
        return self.outputs[size][:n]
