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
``run`` takes them from there (``token_source``).

``emulate=True`` (tests, on CPU): no capture; each "replay" runs the model on the static buffers,
under :class:`GraphSafetyCheck`. That checks, without a GPU, what a captured graph relies on: the
forward reads the step only from the buffers (the context's host lists hold the same placeholders
as at capture), padding rows change nothing, and no op needs the host (a scalar read, ``tolist``,
``nonzero``, boolean-mask indexing: each would synchronise, or fail capture)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cluster.common.kv_spec import KVGroupSpec
from cluster.engine.batch import HostBatch, take_pending_tokens
from cluster.models.context import ForwardContext
from cluster.models.ops import REFERENCE_OPS, Ops
from kernels.spec_decode import commit_states_ref, verify_chain_ref, verify_group_rows_ref

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


@dataclass(frozen=True)
class GraphStatus:
    """Whether decode steps replay captured CUDA graphs, and if not, why. Decode is several times
    slower without them, so the engine says so at start-up (a warning on a GPU), in its
    ``/v1/backends`` row ``cuda_graphs`` and in the gauge ``cluster:cuda_graphs_captured``."""

    #: Captured batch sizes; empty when graphs are off.
    sizes: tuple[int, ...] = ()
    #: Why graphs are off (empty when captured).
    reason: str = ""
    #: The batch size checked against the eager forward after capture.
    verified_size: int = 0

    @property
    def captured(self) -> bool:
        return bool(self.sizes)

    def __bool__(self) -> bool:
        return self.captured

    def describe(self) -> str:
        if self.captured:
            return (f"captured: batch sizes {', '.join(map(str, self.sizes))} "
                    f"(batch {self.verified_size} verified against the eager forward)")
        return f"off: {self.reason}"


class GraphUnsafeError(RuntimeError):
    """An op that a CUDA graph cannot hold ran in a forward meant to be captured."""


#: Ops whose result or shape depends on tensor values read on the host.
_HOST_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::nonzero_static", "aten::masked_select",
             "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
             "aten::equal", "aten::is_nonzero"}


class GraphSafetyCheck(TorchDispatchMode):
    """Raises GraphUnsafeError on any op that reads tensor values on the host (and on
    ``Tensor.tolist``, which dispatches nothing). Used by emulated graphs."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if name in _HOST_OPS:
            raise GraphUnsafeError(f"{name} reads device values on the host inside a decode graph")
        if name == "aten::lift_fresh" and args[0].dim() > 0:  # scalars are kernel arguments: constants
            raise GraphUnsafeError("a tensor made from host data inside a decode graph: a copy from "
                                   "pageable memory, its values frozen at capture")
        if name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            raise GraphUnsafeError(f"{name} with a boolean mask has a data-dependent shape")
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> "GraphSafetyCheck":
        self._tolist = original = torch.Tensor.tolist
        owner = threading.get_ident()  # dispatch modes are per thread; so is this refusal

        def refuse(tensor: torch.Tensor) -> Any:
            if threading.get_ident() != owner:
                return original(tensor)
            raise GraphUnsafeError("Tensor.tolist reads device values on the host inside a decode graph")
        torch.Tensor.tolist = refuse  # type: ignore[method-assign, assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)


class EmulatedGraph:
    """Stands in for a captured graph on CPU: replaying runs ``owner.forward(size)`` on the static
    buffers (under GraphSafetyCheck) into ``owner.outputs[size]``. Serves DecodeGraphs and
    DraftHeadGraphs alike."""

    def __init__(self, owner: Any, size: int) -> None:
        self.owner, self.size = owner, size

    def replay(self) -> None:
        with GraphSafetyCheck():
            self.owner.outputs[self.size] = self.owner.forward(self.size)


def capture_sizes(forward: Callable[[int], torch.Tensor], sizes: list[int],
                  outputs: dict[int, torch.Tensor], pool: Any = None) -> dict[int, Any]:
    """Capture ``forward(size)`` for every size, the largest first, in one memory pool (``pool``,
    else a new one); each graph's output tensor lands in ``outputs[size]``. Returns the graphs by
    size."""
    if pool is None:
        pool = torch.cuda.graph_pool_handle()
    graphs: dict[int, Any] = {}
    for size in reversed(sizes):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[size] = forward(size)
        graphs[size] = graph
    return graphs


def warm_and_capture(forwards: Sequence[tuple[Callable[[int], Any], dict[int, Any]]], sizes: list[int],
                     device: torch.device, timings: dict[str, float], prefix: str = "",
                     per_size: bool = False) -> list[dict[int, Any]]:
    """Run every ``(forward, outputs)`` at every size eagerly (compilation, autotuning and lazy
    copies stay outside the graphs), then capture each from the largest size down, all in one
    memory pool, each graph's output into its ``outputs``. Seconds land in ``timings``:
    ``{prefix}warmup_s`` (per size ``{prefix}warmup_b{size}_s`` with ``per_size``) and
    ``{prefix}capture_s``. Returns each forward's graphs by size."""
    start = time.perf_counter()
    for forward, _ in forwards:
        for size in sizes:
            began = time.perf_counter()
            forward(size)
            if per_size:
                torch.cuda.synchronize(device)
                timings[f"{prefix}warmup_b{size}_s"] = time.perf_counter() - began
    torch.cuda.synchronize(device)
    if not per_size:
        timings[f"{prefix}warmup_s"] = time.perf_counter() - start
    start = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    graphs = [capture_sizes(forward, sizes, outputs, pool) for forward, outputs in forwards]
    torch.cuda.synchronize(device)
    timings[f"{prefix}capture_s"] = time.perf_counter() - start
    return graphs


def capture_with_status(graphs: Any, device: torch.device, what: str, fallback: str) -> GraphStatus:
    """``graphs.capture()``, and the status it leaves: captured sizes, or why not (a capture or
    a self-check that fails is logged as a warning; ``fallback`` says what runs instead)."""
    try:
        graphs.capture()
    except Exception as exc:  # noqa: BLE001 - what cannot be captured still runs, eagerly
        failure = "self-check failed" if isinstance(exc, GraphUnsafeError) else "capture failed"
        logger.warning("%s CUDA graphs: %s; %s", what, failure, fallback, exc_info=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return GraphStatus(reason=f"{failure}: {type(exc).__name__}: {exc}")
    return GraphStatus(sizes=tuple(graphs.sizes), verified_size=graphs.verified_size)


def stage(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without waiting for the GPU: through pinned memory (a copy from
    pageable memory would synchronise)."""
    staged = torch.from_numpy(host)
    if device.type == "cuda":
        staged = staged.pin_memory()
    return staged.to(device, non_blocking=True)


def stage_tables(tables: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Block tables (per KV group ``[n, W_g]``) on ``device`` as ``stage`` puts them: one copy."""
    host = np.concatenate([np.ascontiguousarray(t, dtype=np.int32).reshape(-1) for t in tables])
    staged = stage(host, device)
    out, offset = [], 0
    for t in tables:
        out.append(staged[offset:offset + t.size].view(t.shape))
        offset += t.size
    return out


def fetch(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying ``values`` to the host without waiting for the GPU: a pinned host tensor
    and the event after the copy (``values`` itself and None on a CPU, where it has run)."""
    if not values.is_cuda:
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, specs: list[KVGroupSpec], kv_caches: list[torch.Tensor],
                 device: torch.device, max_batch: int, max_model_len: int, emulate: bool = False,
                 verify_states: list[torch.Tensor | None] | None = None, verify_depth: int = 1) -> None:
        self.emulate = emulate
        self.model = model
        self.ops: Ops = getattr(model, "ops", REFERENCE_OPS)
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
            # verify steps of a model with state groups (see ForwardContext): -1 in plain decode rows
            self.verify_slot = torch.full((b,), -1, dtype=torch.int64) if verify_states is not None else None
            self.verify_prev = torch.full((b,), -1, dtype=torch.int64) if verify_states is not None else None
        self.verify_states = verify_states
        self.verify_depth = verify_depth
        self.graphs: dict[int, Any] = {}  # torch.cuda.CUDAGraph, or EmulatedGraph
        self.outputs: dict[int, torch.Tensor] = {}
        #: Start-up seconds by phase (``capture``).
        self.timings: dict[str, float] = {}
        self.verified_size = 0

    def _context(self, size: int) -> ForwardContext:
        ctx = ForwardContext(
            positions=self.positions[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], query_start_loc_cpu=list(range(size + 1)),
            # The decode kernel sizes its split count from the longest possible context, so one
            # captured graph serves every context length.
            seq_lens_cpu=[self.max_model_len] * size, kv_caches=self.kv_caches,
            block_tables=[t[:size] for t in self.block_tables],
            slot_mappings=[s[:size] if s is not None else None for s in self.slot_mappings],
            block_sizes=[spec.block_size for spec in self.specs])
        if self.verify_slot is not None and self.verify_prev is not None:
            ctx.verify_slot, ctx.verify_prev = self.verify_slot[:size], self.verify_prev[:size]
            ctx.verify_depth, ctx.verify_states = self.verify_depth, self.verify_states
        return ctx

    def forward(self, size: int) -> torch.Tensor:
        """The model on the first ``size`` rows of the buffers (what a graph of ``size`` holds)."""
        return self.model(self.input_ids[:size], self._context(size))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every size up eagerly (compilation and autotuning stay outside the graphs), then
        capture from the largest size down, sharing one memory pool, then ``verify``. Seconds
        spent per phase (and warming up each size) land in ``timings``."""
        if self.emulate:
            self.graphs = {size: EmulatedGraph(self, size) for size in self.sizes}
            self.verified_size = self.verify()
            return
        self.graphs, = warm_and_capture([(self.forward, self.outputs)], self.sizes, self.device, self.timings,
                                        per_size=True)
        start = time.perf_counter()
        self.verified_size = self.verify()
        self.timings["verify_s"] = time.perf_counter() - start
        logger.info("captured decode CUDA graphs for batch sizes %s (batch %d verified against the eager "
                    "forward)", self.sizes, self.verified_size)

    def verify_size(self) -> int:
        """The largest captured size whose rows can each own a block of every group (block 0 is the
        null block): ``verify`` gives row i block i + 1."""
        free = min(int(cache.shape[0]) for cache in self.kv_caches) - 1
        return max(s for s in self.sizes if s <= free) if free >= self.sizes[0] else 0

    @torch.inference_mode()
    def verify(self, rtol: float = 2e-2) -> int:
        """Replay a graph on inputs it was not captured with and compare with the same forward run
        eagerly: a graph that froze a value at capture gives other hidden states. Each row is a
        fresh sequence at position 0 in a block of its own in every group (row i: block i + 1), so
        no two rows write or read the same KV slot: rows that shared one would read whichever row
        wrote last, which on a GPU differs between two runs. Those blocks (free at start-up) get
        their bytes back afterwards. Checks the largest size that has a block per row
        (``verify_size``) and returns it; raises GraphUnsafeError (the runner then decodes eagerly)."""
        size = self.verify_size()
        if size == 0:
            raise GraphUnsafeError("no KV block to verify a decode graph with (the pool holds only the null block)")
        vocab = int(getattr(self.model, "vocab_size", 2))
        generator = torch.Generator(device=self.device).manual_seed(0)
        saved = [cache[1:size + 1].clone() for cache in self.kv_caches]
        own = torch.arange(1, size + 1, device=self.device)
        self.input_ids[:size].copy_(torch.randint(0, vocab, (size,), generator=generator, device=self.device))
        self.positions.zero_()
        self.seq_lens.fill_(1)
        for table in self.block_tables:
            table.zero_()
            table[:size, 0] = own.to(table.dtype)
        for spec, slots in zip(self.specs, self.slot_mappings):
            if slots is not None:
                slots[:size] = own * spec.block_size
        try:
            expected = self.forward(size).float()
            self.graphs[size].replay()
            got = self.outputs[size].float()
        finally:
            for table in self.block_tables:
                table.zero_()
            for slots in self.slot_mappings:
                if slots is not None:
                    slots.fill_(-1)
            for cache, before in zip(self.kv_caches, saved):
                cache[1:size + 1].copy_(before)
        scale = float(expected.abs().max())
        error = float((got - expected).abs().max())
        if not error <= rtol * max(scale, 1e-6):
            raise GraphUnsafeError(f"decode graph of batch {size} replayed other hidden states than the "
                                   f"eager forward (max error {error:.3g}, scale {scale:.3g})")
        return size

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
        if self.verify_slot is not None and self.verify_prev is not None:
            none = np.full(n, -1, dtype=np.int64)
            columns += [(self.verify_slot, none if batch.verify_slot is None else batch.verify_slot, -1),
                        (self.verify_prev, none if batch.verify_prev is None else batch.verify_prev, -1)]
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
        staged = stage(host, self.device)
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

    @torch.inference_mode()
    def run_on_device(self, inputs: torch.Tensor, base: torch.Tensor, tables: Sequence[torch.Tensor],
                      live: torch.Tensor | None = None, replay: bool = True) -> torch.Tensor:
        """A verify step whose tokens and positions are on the device (pipelined: the host does
        not know how far the step in flight advanced): request ``i``'s ``inputs[i, j]`` is one
        decode row at ``base[i] + j`` over its row of ``tables`` (per KV group, ``[n, W_g]`` on the
        device; the first group per-token, the draft head's or the MTP layer's), its slots looked up
        there; a request whose ``live`` is false (padding) reads the null block and writes nowhere.
        A model with ``state`` groups keeps each verified position's state in a scratch row until
        ``commit_states``. Replays the graph, or (``replay=False``, inside another graph's capture)
        runs its forward on the buffers. Returns hidden states ``[n * (k + 1), H]``, request by
        request."""
        assert self.slot_mappings[0] is not None, "verify rows need a per-token first KV group"
        assert len(tables) == len(self.specs), f"{len(tables)} block tables for {len(self.specs)} KV groups"
        n, r = inputs.shape
        rows = n * r
        size = next(s for s in self.sizes if s >= rows)
        self.ops.spec_verify_rows(inputs, base, live, tables[0], self.specs[0].block_size, self.input_ids[:size],
                                  self.positions[:size], self.seq_lens[:size], self.slot_mappings[0][:size],
                                  self.block_tables[0][:size])
        for g in range(1, len(self.specs)):
            slots = self.slot_mappings[g]
            verify_group_rows_ref(base, live, r, tables[g], self.specs[g].block_size,
                                  slots[:size] if slots is not None else None, self.block_tables[g][:size])
        if self.verify_slot is not None and self.verify_prev is not None:
            verify_chain_ref(n, r, live, self.verify_slot[:size], self.verify_prev[:size])
        if not replay:
            return self.forward(size)[:rows]
        self.graphs[size].replay()
        return self.outputs[size][:rows]

    @property
    def verify_rows_limit(self) -> int:
        """The most rows a verify step launched by ``run_on_device`` may have: the graphs' largest
        size, and for a model with ``state`` groups the scratch rows but the spare one."""
        limit = self.max_batch
        for scratch in self.verify_states or ():
            if scratch is not None:
                limit = min(limit, int(scratch.shape[0]) - 1)
        return limit

    @torch.inference_mode()
    def commit_states(self, tables: Sequence[torch.Tensor], base: torch.Tensor, accepted: torch.Tensor,
                      live: torch.Tensor | None, r: int) -> None:
        """After ``run_on_device`` and the acceptance (``accepted [n]`` drafts), on the device: each
        ``state`` group keeps the states a synchronous step's ``ModelRunner.commit_verified``
        keeps (the newest accepted position's and every accepted block end's), so the groups are
        those of requests that never saw their rejected drafts."""
        for g, scratch in enumerate(self.verify_states or ()):
            if scratch is not None:
                commit_states_ref(self.kv_caches[g], scratch, tables[g], base, accepted, live, r,
                                  self.specs[g].block_size)
