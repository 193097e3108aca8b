"""DSparkRunner: drafts with DeepSeek-V4's DSpark drafter (cluster/models/deepseek_v4_dspark.py)
next to the target, on the same device and KV storage.

The drafter's state is its stages' context entries, which the target's forward writes for every
row it computes (more layers of the ``swa`` group): there is nothing to catch up after a step and
nothing to roll back after a rejection (a block at ``P`` reads positions below ``P`` only, all of
them verified). A proposal is one block per request, ``dspark_block_size`` rows through the
stages, then the Markov head row by row; ``dspark_confidence_threshold`` > 0 stops a block at its
first draft whose confidence (``sigmoid``) is below it, so fewer positions are verified. On a
GPU with ``dspark_cuda_graphs`` a proposal replays a captured CUDA graph (``DSparkGraphs``,
cluster/engine/dspark_graphs.py); where none is captured (the setting off, a CPU,
``enforce_eager``, a failed capture: ``graph_status`` says why, as ``/v1/backends`` does) the
block's kernels are launched from Python.

Disaggregated: the prefill replica's forward wrote the prompt's entries, which travel with the
``swa`` blocks; its hand-over is a layout descriptor and a CRC32 of the entries the first block
reads (positions ``L - window .. L - 1`` of every stage), which the decode replica checks against
the blocks it received before drafting. A hand-over that is missing or does not match turns
drafting off for that request, loudly (log, ``dspark_handover_rejected_total``): its output stays
exact, and it is never drafted from wrong state.
"""
from __future__ import annotations

import json
import logging
import zlib
from typing import Any, Sequence

import numpy as np
import torch

from cluster.common.errors import UnsupportedSettingError
from cluster.engine.batch import pad_tables
from cluster.engine.cuda_graphs import GraphStatus, capture_with_status
from cluster.engine.dspark_graphs import DSparkGraphs
from cluster.engine.draft_runner import DraftJob

logger = logging.getLogger(__name__)


class DSparkRunner:
    #: No draft-head graphs: those serve pipelined verify steps, which DSpark does not have yet (its
    #: verify steps run synchronously). Its blocks replay their own graphs (``block_graphs``).
    graphs = None

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], block_size: int, device: torch.device,
                 num_tokens: int, confidence_threshold: float = 0.0, cuda_graphs: bool = False) -> None:
        drafter = getattr(model, "dspark", None)
        if drafter is None or not getattr(model, "drafts_with_dspark", False):
            raise UnsupportedSettingError(
                "speculative_method='dspark' needs the checkpoint's DSpark drafter (dspark_* config keys and its "
                "mtp.<stage>.* weights); this model has none", param="speculative_method")
        spec = drafter.spec
        if num_tokens > spec.block_size:
            raise UnsupportedSettingError(
                f"num_speculative_tokens={num_tokens} exceeds the DSpark block ({spec.block_size} tokens, "
                "dspark_block_size): its drafter proposes one block per step", param="num_speculative_tokens")
        self.model, self.drafter = model, drafter
        self.kv_caches, self.block_size, self.device = kv_caches, block_size, device
        self.threshold = confidence_threshold
        #: Whether ``capture_graphs`` captures the blocks (``dspark_cuda_graphs``).
        self.cuda_graphs = cuda_graphs
        self.hidden_size = 0  # no hidden state is kept or handed over
        self.graph_status = GraphStatus(reason="not captured")
        #: The blocks as captured CUDA graphs (``capture_graphs``).
        self.block_graphs: DSparkGraphs | None = None
        #: Requests that draft nothing: their hand-over was missing or did not match.
        self.disabled: set[str] = set()
        self.num_blocks = 0
        #: Proposals replayed from a graph / drafted eagerly.
        self.num_graph_blocks = 0
        self.num_eager_blocks = 0
        self.num_block_rows = 0
        self.num_early_stops = 0
        self.num_handovers_checked = 0
        self.num_handovers_rejected = 0

    def capture_graphs(self, num_tokens: int, max_batch: int, table_width: int, max_model_len: int,
                       emulate: bool = False) -> GraphStatus:
        """Capture the block proposal (``DSparkGraphs``) for up to ``max_batch`` requests whose
        ``swa`` tables have at most ``table_width`` blocks; a capture or self-check that fails
        leaves the blocks eager, and the returned status (also ``graph_status``) says why."""
        if not self.cuda_graphs:
            self.graph_status = GraphStatus(reason="dspark_cuda_graphs is off: each block launches its kernels "
                                                   "from Python")
            return self.graph_status
        if self.device.type != "cuda" and not emulate:
            self.graph_status = GraphStatus(reason=f"the device is {self.device.type}: CUDA graphs need a CUDA device")
            return self.graph_status
        graphs = DSparkGraphs(self, max_batch, table_width, max_model_len, emulate=emulate)
        self.graph_status = capture_with_status(graphs, self.device, "DSpark block", "its blocks are drafted eagerly")
        if self.graph_status.captured:
            self.block_graphs = graphs
        return self.graph_status

    # --- state (all of it in the KV groups) -------------------------------------------------------

    def observe(self, scheduled: Sequence[Any], block_tables: dict[str, list[list[int]]],
                hidden: torch.Tensor) -> None:
        """Nothing to do: the target's forward wrote the stages' entries for its rows."""

    def forget(self, request_id: str) -> None:
        self.disabled.discard(request_id)

    def fork(self, parent: str, child: str, position: int) -> None:
        if parent in self.disabled:  # the child took the parent's blocks, entries and all
            self.disabled.add(child)

    def written_upto(self, request_id: str) -> int | None:
        return None  # the entries of a position are written with the target's KV

    # --- the hand-over ---------------------------------------------------------------------------

    def layout(self) -> dict[str, Any]:
        spec, args = self.drafter.spec, self.drafter.args
        cache = self.kv_caches[self.drafter.layers[0][0]]
        return {"drafter": "dspark", "stages": spec.num_stages, "layers": [list(x) for x in self.drafter.layers],
                "window": args.sliding_window, "width": int(cache.shape[-1]), "dtype": str(cache.dtype),
                "kv_block_size": self.block_size, "target_layer_ids": list(spec.target_layer_ids),
                "block": spec.block_size}

    def _checksum(self, tables: list[list[int]], position: int) -> int:
        """CRC32 of every stage's entries at ``position - window .. position - 1`` (the first
        block's context), read through the request's ``swa`` block table."""
        window = self.drafter.args.sliding_window
        pos = np.arange(max(0, position - window), position)
        table = np.asarray(tables[self.drafter.layers[0][0]], dtype=np.int64)
        blocks = torch.from_numpy(table[pos // self.block_size]).to(self.device)
        offsets = torch.from_numpy(pos % self.block_size).to(self.device)
        crc = 0
        for group, layer in self.drafter.layers:
            rows = self.kv_caches[group][:, layer][blocks, offsets].contiguous().cpu()
            crc = zlib.crc32(rows.view(torch.uint8).numpy().tobytes(), crc)
        return crc

    def handover(self, request_id: str, tables: list[list[int]], position: int) -> bytes | None:
        """Prefill side: what the decode replica checks before drafting for ``request_id``."""
        return json.dumps({**self.layout(), "position": position,
                           "crc32": self._checksum(tables, position)}).encode()

    def receive(self, request_id: str, tables: list[list[int]], position: int, blob: bytes | None) -> bool:
        """Decode side: the request's blocks landed; draft for it only if the hand-over matches
        them (False: drafting is off for it, said loudly)."""
        self.num_handovers_checked += 1
        reason = ""
        if blob is None:
            reason = "the prefill replica handed over no DSpark state (was it started with speculative_method=dspark?)"
        else:
            try:
                got = json.loads(blob.decode())
            except (UnicodeDecodeError, json.JSONDecodeError):
                got = {}
            want = {**self.layout(), "position": position}
            diff = sorted(k for k in want if got.get(k) != want[k])
            if diff:
                reason = f"its layout differs in {', '.join(diff)} ({ {k: got.get(k) for k in diff} } here " \
                         f"{ {k: want[k] for k in diff} })"
            elif got.get("crc32") != self._checksum(tables, position):
                reason = "the checksum of the drafter's entries in the received blocks does not match the prefill side's"
        if not reason:
            return True
        self.num_handovers_rejected += 1
        self.disabled.add(request_id)
        logger.error("DSpark hand-over for request %s rejected: %s; it decodes without drafting", request_id, reason)
        return False

    # --- proposals -------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, jobs: Sequence[DraftJob], block_tables: dict[str, list[list[int]]]) -> dict[str, list[int]]:
        """One block per job; a job drafts at most ``num_tokens`` tokens (fewer after an early stop)."""
        out: dict[str, list[int]] = {job.request_id: [] for job in jobs if job.request_id in self.disabled}
        live = [job for job in jobs if job.request_id not in self.disabled]
        if not live:
            return out
        group = self.drafter.layers[0][0]
        rows = [block_tables[job.request_id][group] for job in live]
        graphs = self.block_graphs
        if graphs is not None and graphs.can_run(rows):
            self.num_graph_blocks += 1
            drafts, confidence = graphs.run(rows, [job.token for job in live], [job.position for job in live])
        else:
            self.num_eager_blocks += 1
            tables = pad_tables(rows)
            dev = self.device
            anchors = torch.tensor([job.token for job in live], dtype=torch.long, device=dev)
            positions = torch.tensor([job.position for job in live], dtype=torch.long, device=dev)
            model = self.model
            drafts, _, confidence = self.drafter.draft_block(model.embed, model.head_logits, model.rope,
                                                             self.kv_caches, torch.from_numpy(tables).to(dev),
                                                             anchors, positions)
        self.num_blocks += 1
        self.num_block_rows += len(live) * self.drafter.spec.block_size
        table = drafts.tolist()
        sure = torch.sigmoid(confidence).tolist() if self.threshold > 0 else None
        for i, job in enumerate(live):
            n = job.num_tokens
            if sure is not None:
                cut = next((j for j in range(n) if sure[i][j] < self.threshold), n)
                self.num_early_stops += cut < n
                n = cut
            out[job.request_id] = table[i][:n]
        return out

    def counters(self) -> dict[str, float]:
        return {"dspark_blocks_total": float(self.num_blocks),
                "dspark_graph_blocks_total": float(self.num_graph_blocks),
                "dspark_eager_blocks_total": float(self.num_eager_blocks),
                "dspark_block_rows_total": float(self.num_block_rows),
                "dspark_early_stops_total": float(self.num_early_stops),
                "dspark_handovers_checked_total": float(self.num_handovers_checked),
                "dspark_handover_rejected_total": float(self.num_handovers_rejected)}
