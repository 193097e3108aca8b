"""A cluster simulator for the prefill:decode planner: prefill and decode replicas of one GPU
each (or colocated replicas doing both), a cost model calibrated on our committed H200 results,
continuous batching as our scheduler does it, the router's pairing rules, and the project's own
``cluster.router.planner.plan`` called every planning interval with Serve's delays (a new
replica serves only after its start-up; a removed one drains first).

The model is fluid, in ticks of ``dt`` seconds (vectorised over requests with numpy):
- decode replica: every tick it runs ``dt / step`` steps of its whole batch, where a step reads
  the weights and the batch's KV at the copy bandwidth times the measured engine efficiency
  for that batch size (``engine-h200-*.json``), plus a fixed host cost per step; each step gives
  every running request one token, and every token's inter-token latency is that step time;
- prefill replica: FIFO, at ``prefill_flops_s`` of useful FLOPs (calibrated, below); a prompt's
  first token leaves with its KV after the transfer time (``transfer-h200-*.json``: bytes at the
  measured ``ipc`` bandwidth plus its fixed cost);
- colocated replica: each step carries its decode batch and a prefill chunk that fills the token
  budget (running requests first, as our scheduler): prefill stalls decode, which is what
  disaggregation removes;
- KV: a decode replica admits a request (reserving prompt + output tokens) when it has room, as
  our decode worker reserves before any prefill is spent; otherwise the request waits;
- routing: decode replica with the most free KV, prefill replica with the least queued tokens.

Calibration (``bench/simulate_validation.py``): the prefill rate comes from the engine's
throughput row; four host constants are fitted on the disaggregated rows of one single-GPU
serving run (``serve-h200-*.json``): per decode step, fixed and per running sequence (host and GPU
overlap, a step takes the longer), and a first token's host path (fixed, plus turns of the decode
loop). Every other row, and the other runs, are predicted and the residuals reported.

    python bench/simulate.py --validate --out bench/results/simulate-validation.json
    python bench/simulate.py --compare --gpus 8,64,512 --out bench/results/simulate-planner.json
    python bench/simulate.py --tiny      # a quick plumbing check
"""
from __future__ import annotations

import argparse
import bisect
import dataclasses
import glob
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, write_result  # noqa: E402
from cluster.common.reporting import REPORT_PERIOD_S, arrival_rate_cv2  # noqa: E402
from cluster.config import SchedulerConfig, TransferConfig  # noqa: E402
from cluster.engine.scheduler import ChunkSizer  # noqa: E402
from cluster.router.planner import Demand, Observation, PlannerSettings, PlannerState, RoleLoad, plan  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: Qwen3-8B: per layer q/o 4096x4096, k/v 4096x1024, MLP 3 x 4096 x 12288 (bf16).
LAYER_PARAMS = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 12288
LM_HEAD_PARAMS = 151936 * 4096
KV_BYTES_PER_TOKEN_PER_LAYER = 2 * 8 * 128 * 2


def latest(pattern: str) -> dict[str, Any]:
    paths = sorted(glob.glob(os.path.join(RESULTS, pattern)))
    if not paths:
        raise FileNotFoundError(pattern)
    with open(paths[-1]) as f:
        data = json.load(f)
    data["_file"] = os.path.basename(paths[-1])
    return data


# --- the cost model ---------------------------------------------------------------------------------

@dataclass
class Costs:
    layers: int = 36
    bandwidth: float = 4.2e12  # bytes/s
    #: engine decode efficiency (fraction of the roofline) at batch 1 and 32 (engine-h200-*.json)
    eff_b1: float = 0.887
    eff_b32: float = 0.816
    #: Host time per decode step: a fixed part and one per running sequence (each sequence's new
    #: token is a StepOutput yielded through a Ray streaming call to the ingress). Decode is
    #: pipelined, so host and GPU work overlap and a step takes the longer of the two.
    step_overhead_s: float = 0.0005
    step_per_seq_s: float = 0.0
    host_overlaps_gpu: bool = True
    #: Host time on a first token's path besides prefill and transfer: a fixed part (the
    #: ingress -> decode -> prefill -> decode -> ingress hops) and turns of the decode replica's
    #: loop (admission, the prefill's reply, the first token's yield), each as long as its step.
    ttft_fixed_s: float = 0.0
    first_token_steps: float = 0.0
    prefill_flops_s: float = 3e14
    prefill_overhead_s: float = 0.002
    transfer_bw: float = 1.0e12
    transfer_fixed_s: float = 0.0003
    kv_tokens: float = 7e5  # KV capacity of one replica, tokens
    startup_s: float = 60.0
    max_batched_tokens: int = 8192
    max_num_seqs: int = 256
    #: Of the tokens a stream carries, the share that brings no text of its own (a piece of a
    #: character, text held back): the client's chunk then carries it with the next token, so
    #: that chunk's gap spans two steps. The benchmark's ITL is per text chunk; TPOT per token.
    #: 0: every token its own chunk.
    textless_token_share: float = 0.0
    #: How a streamed gap of one step scatters about the step (the host's other work, the HTTP
    #: stream): offsets in the ITL histogram's log bins (80 a decade) and their weights, median at
    #: 0 (``gap_spread``). Empty: every gap exactly its steps.
    gap_spread_bins: tuple[int, ...] = ()
    gap_spread_weights: tuple[float, ...] = ()
    sources: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def weight_bytes(self) -> float:
        return 2.0 * (self.layers * LAYER_PARAMS + LM_HEAD_PARAMS)

    @property
    def kv_bytes_per_token(self) -> float:
        return self.layers * KV_BYTES_PER_TOKEN_PER_LAYER

    def flops_per_token(self, context: float) -> float:
        attention = 4 * 4096 * context / 2 * self.layers  # causal: half the context on average
        return 2.0 * self.layers * LAYER_PARAMS + attention

    def efficiency(self, batch: np.ndarray) -> np.ndarray:
        x = np.clip(np.log2(np.maximum(batch, 1)) / 5.0, 0.0, 1.0)
        return self.eff_b1 + (self.eff_b32 - self.eff_b1) * x

    def decode_parts(self, batch: np.ndarray, context_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A decode step's GPU time and host time, seconds."""
        moved = self.weight_bytes + self.kv_bytes_per_token * context_tokens
        gpu = moved / (self.bandwidth * self.efficiency(batch))
        return gpu, self.step_overhead_s + self.step_per_seq_s * batch

    def combine(self, gpu: np.ndarray, host: np.ndarray) -> np.ndarray:
        return np.maximum(gpu, host) if self.host_overlaps_gpu else gpu + host

    def decode_step(self, batch: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        return self.combine(*self.decode_parts(batch, context_tokens))

    def first_token_delay(self, step: float) -> float:
        """Host time between a prompt's KV landing and its first token reaching the client."""
        return self.ttft_fixed_s + self.first_token_steps * step

    def prefill_seconds(self, tokens: float, context: float) -> float:
        return tokens * self.flops_per_token(context) / self.prefill_flops_s

    def transfer_seconds(self, tokens: float) -> float:
        return self.transfer_fixed_s + tokens * self.kv_bytes_per_token / self.transfer_bw

    def chunk_step_compute(self, batch: float, gpu: float, chunk: float, head: float) -> float:
        """The compute of a step that carries ``chunk`` tokens of a ``head``-token prompt beside
        ``batch`` decoding requests (whose decode-only step's compute is ``gpu``)."""
        return gpu * (batch > 0) + self.prefill_seconds(chunk, head)

    def chunk_tokens(self, target_s: float, batch: float, gpu: float, host: float, head: float) -> float:
        """The prompt tokens that bring such a step to ``target_s`` (negative: none fit)."""
        return float((target_s - self.combine(gpu * (batch > 0), host)) / self.prefill_seconds(1.0, head))

    @classmethod
    def from_results(cls, layers: int = 36) -> Costs:
        engine = latest("engine-h200-*.json")
        transfer = latest("transfer-h200-*.json")
        rows = engine["rows"]
        sizes = transfer["ipc"]["per_size"]
        largest = max(sizes, key=int)
        c = cls(layers=layers, bandwidth=engine["copy_bandwidth_GBps"] * 1e9,
                eff_b1=rows["decode-b1"]["pct_of_roofline"] / 100, eff_b32=rows["decode-b32"]["pct_of_roofline"] / 100,
                transfer_bw=sizes[largest]["gb_s"] * 1e9,
                transfer_fixed_s=sizes[min(sizes, key=int)]["send_ms"] / 1e3 / 2)
        # the engine run's model has its own depth (Qwen3-8B's 36 layers): price its steps with it
        c.prefill_flops_s = dataclasses.replace(c, layers=int(engine["config"]["num_hidden_layers"]))._prefill_rate(rows)
        c.sources = {"engine": engine["_file"], "transfer": transfer["_file"],
                     "prefill_flops_s": "engine throughput row less its decode steps at this cost model's price"}
        return c

    def _prefill_rate(self, rows: dict[str, Any]) -> float:
        """Useful prefill FLOP/s of the engine alone (``throughput-<n>x<prompt>+<new>``: n prompts
        prefilled, then ``new`` decode steps of the whole batch, which the GPU cost prices)."""
        name = next(k for k in rows if k.startswith("throughput-"))
        n, rest = name.split("-", 1)[1].split("x")
        prompt, new = (int(x) for x in rest.split("+"))
        n = int(n)
        gpu, _ = self.decode_parts(np.array([float(n)]), np.array([n * (prompt + new / 2)]))
        prefill_s = rows[name]["wall_s"] - new * float(gpu[0])
        return n * prompt * self.flops_per_token(prompt) / prefill_s


# --- workloads -------------------------------------------------------------------------------------

#: name -> (prompt tokens mean, output tokens mean): lognormal around them, sigma 0.5.
MIXES = {"chat": (512, 384), "rag": (4096, 128), "code": (6144, 768)}


@dataclass
class Phase:
    seconds: float
    rate: float  # requests per second
    mix: str
    bursty: bool = False


def make_requests(phases: list[Phase], seed: int = 0, max_len: int = 16384) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrivals, prompts, outputs, phase_of = [], [], [], []
    start = 0.0
    for i, ph in enumerate(phases):
        n = rng.poisson(ph.rate * ph.seconds)
        if ph.bursty:  # on/off: the same mean rate in bursts of 3x for a third of the time
            t = rng.uniform(0, ph.seconds / 3, n)
            t = (t // 5.0) * 15.0 + t % 5.0
            t = t[t < ph.seconds]
        else:
            t = rng.uniform(0, ph.seconds, n)
        t = np.sort(t) + start
        p_mean, o_mean = MIXES[ph.mix]
        arrivals.append(t)
        prompts.append(np.clip(rng.lognormal(math.log(p_mean), 0.5, len(t)), 16, max_len // 2).astype(np.int64))
        outputs.append(np.clip(rng.lognormal(math.log(o_mean), 0.5, len(t)), 8, max_len // 2).astype(np.int64))
        phase_of.append(np.full(len(t), i))
        start += ph.seconds
    return {"arrival": np.concatenate(arrivals), "prompt": np.concatenate(prompts),
            "output": np.concatenate(outputs), "phase": np.concatenate(phase_of)}


# --- the simulator ---------------------------------------------------------------------------------

WAIT, PREFILL, TRANSFER, DECODE, DONE = 0, 1, 2, 3, 4
#: The comparison's default ``Simulation.local_chunk_itl`` (``--local-chunk-itl``): what a served
#: decode replica does (``TransferConfig.local_prefill_itl_share``; its engine sizes prompt chunks
#: from measured steps, cluster.engine.scheduler.ChunkSizer).
LOCAL_CHUNK_ITL = TransferConfig().local_prefill_itl_share

#: The comparison's default ``Simulation.local_prefill_wait`` (``--local-prefill-wait``): prefill on
#: the decode replica once the prefill pool's expected wait passes half the TTFT target.
LOCAL_PREFILL_WAIT = 0.5


#: How often the colocated replicas' chunk cap is sampled (``Simulation.cap_samples``): as the
#: served replicas report theirs (``cluster.common.reporting.REPORT_PERIOD_S``).
CAP_SAMPLE_S = REPORT_PERIOD_S
#: Prompt tokens left below this count as none (what floating-point progress leaves behind).
TOKEN_EPS = 1e-6


@dataclass
class Replica:
    role: str  # prefill | decode | colocated
    ready_at: float
    draining: bool = False
    drain_since: float = math.inf
    queue: deque = dataclasses.field(default_factory=deque)  # request ids waiting for / in prefill
    queued_tokens: float = 0.0
    head_done: float = 0.0  # prompt tokens of the queue head already computed
    kv_used: float = 0.0
    #: Prefill steps (``Simulation.prefill_steps``): prompt tokens left in the step in progress
    #: and the prompts it completes (their first tokens leave when it ends).
    step_left: float = 0.0
    step_done: list = dataclasses.field(default_factory=list)
    overhead_left: float = -1.0  # of the step's fixed overhead, once its tokens are done (-1: not yet)
    #: The served engine's own ChunkSizer (``Simulation.chunk_sizer``).
    sizer: ChunkSizer | None = None
    #: The engine step in progress that carries a prompt chunk (colocated replicas, decode ones
    #: prefilling locally): its prompt tokens, the queue head's length when it began, and the
    #: fraction of it left (0: the next tick begins a new step).
    chunk: float = 0.0
    chunk_head: float = 0.0
    chunk_left: float = 0.0


def gap_spread(gaps: np.ndarray) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """A measured stream's one-step gaps (0.5-1.6x the median gap: not merged, not two chunks
    read together) as a kernel for ``Costs.gap_spread_bins`` / ``gap_spread_weights``: the
    histogram of their log10 ratio to their median in the ITL histogram's bins (80 a decade)."""
    gaps = np.asarray(gaps, dtype=float)
    gaps = gaps[gaps > 0]
    if not len(gaps):
        return (), ()
    ratio = gaps / np.median(gaps)
    single = ratio[(ratio >= 0.5) & (ratio <= 1.6)]
    single = single / np.median(single)
    offsets = np.round(np.log10(single) * 80).astype(int)
    bins, counts = np.unique(offsets, return_counts=True)
    return tuple(int(b) for b in bins), tuple(float(c) / len(offsets) for c in counts)


def spread_histogram(hist: np.ndarray, bins: tuple[int, ...], weights: tuple[float, ...]) -> np.ndarray:
    """``hist`` with each bin's mass scattered over ``bins`` offsets by ``weights`` (clipped at
    the ends)."""
    if not bins:
        return hist
    out = np.zeros_like(hist)
    idx = np.arange(len(hist))
    for b, w in zip(bins, weights):
        np.add.at(out, np.clip(idx + b, 0, len(hist) - 1), hist * w)
    return out


def gap_steps(output: np.ndarray, chunks: np.ndarray) -> np.ndarray:
    """Decode steps per streamed gap of each request: its ``output - 1`` steps after the first
    token over its ``chunks - 1`` gaps (a request of one chunk: one gap of all its steps)."""
    steps = np.maximum(np.asarray(output, dtype=float) - 1.0, 1.0)
    return np.maximum(steps / np.maximum(np.asarray(chunks, dtype=float) - 1.0, 1.0), 1.0)


class Simulation:
    def __init__(self, costs: Costs, requests: dict[str, np.ndarray], *, prefill: int, decode: int,
                 colocated: bool = False, planner: PlannerSettings | None = None, dt: float = 0.02,
                 interval_s: float = 10.0, ttft_target: float = 1.0, itl_target: float = 0.05,
                 shared_gpu: bool = False, gpus: int | None = None, demand_window: float | None = None,
                 prefill_max_ongoing: int = 512, graceful_shutdown_s: float = 20.0,
                 local_prefill_wait: float | None = None, local_chunk_itl: float | None = None,
                 concurrency: int | None = None, max_time: float = 3600.0,
                 chunk_step_s: float | None = None, prefill_steps: bool = False, chunk_sizer: bool = False,
                 chunk_caps: Sequence[Sequence[float]] | None = None,
                 chunks_per_step: bool = SchedulerConfig().sized_chunks_per_step,
                 chunk_sizer_cap: int | None = None) -> None:
        self.c, self.r, self.dt = costs, requests, dt
        #: Colocated replicas cut their prompt chunks with the engine's own ``ChunkSizer`` (starts
        #: at 256 tokens a step, learns only from steps beside decoding requests, grows at most 2x
        #: a step) aiming at ``chunk_step_s``, instead of the tokens that fill it exactly.
        self.chunk_sizer = chunk_sizer
        #: The sizer's cap as the run begins (None: the engine's first, 256): a replica that served
        #: an earlier run starts from what it learned there.
        self.chunk_sizer_cap = chunk_sizer_cap
        #: What the cap (learned or replayed) bounds, as the served engine's
        #: ``sized_chunks_per_step`` says (its default, as served): the step's prompt tokens
        #: together, taken by the prompts in arrival order, so a second prompt waits while the
        #: first takes the cap (True); or each prompt's chunk (False).
        self.chunks_per_step = chunks_per_step
        #: Or a served replica's cap as it was sampled (``[seconds since the run began, tokens]``,
        #: the gauge ``cluster:prefill_chunk_cap``), replayed: each step takes the latest sample's
        #: (before the first, the sizer's first cap).
        self.chunk_caps = sorted((float(t), float(c)) for t, c in chunk_caps) if chunk_caps else None
        #: The colocated replicas' prompt-chunk cap every ``CAP_SAMPLE_S`` (as the served gauge is
        #: sampled): ``[seconds, tokens]``.
        self.cap_samples: list[tuple[float, float]] = []
        self._next_cap_sample = 0.0
        #: A prefill replica runs steps of up to the token budget packed from its queue in order,
        #: as the engine schedules them (chunked prefill), and a prompt's first token leaves when
        #: the step holding its last chunk ends; the step's overhead is paid once. False: one
        #: prompt after another, each leaving as its own tokens are done (the earlier model).
        self.prefill_steps = prefill_steps
        #: Closed-loop clients (a benchmark's ``--concurrency``): ``concurrency`` requests start at
        #: 0 and each one that ends (finished or failed) starts the next, in order; ``requests``'
        #: arrival times are ignored (the run's are written as they happen). None: open loop.
        self.concurrency = concurrency
        self.pending: deque[int] = deque()
        if concurrency is not None:
            n_req = len(requests["arrival"])
            arrival = np.full(n_req, np.inf)
            arrival[:concurrency] = 0.0
            self.r = dict(requests, arrival=arrival)
            self.pending = deque(range(min(concurrency, n_req), n_req))
        self.max_time = max_time
        self.colocated, self.settings, self.interval = colocated, planner, interval_s
        self.ttft_target, self.itl_target, self.shared_gpu = ttft_target, itl_target, shared_gpu
        #: The router's demand window (arrival rate and lengths): one planning interval, as Dynamo's
        #: planner reads the last adjustment interval's load.
        self.demand_window = demand_window if demand_window is not None else interval_s
        #: PrefillServer's max_ongoing_requests: a prefill replica holds at most this many requests;
        #: the rest wait at the decode replica's handle (KV reserved) for the first replica with room,
        #: a new one included, as Serve's router queues them.
        self.prefill_max_ongoing = prefill_max_ongoing
        #: Serve's graceful_shutdown_timeout_s (default 20): a draining replica is stopped after it.
        self.graceful_shutdown_s = graceful_shutdown_s
        #: Queue-aware conditional disaggregation (as Dynamo's router: prefill on the decode worker
        #: when the prefill queue is long): in a disaggregated cluster, a request whose expected wait
        #: for the prefill pool (its queued prompt tokens, the handle's included, over the ready
        #: replicas' prefill rate) exceeds this fraction of the TTFT target is prefilled by its decode
        #: replica, chunked with that replica's decode batch as a colocated replica does. None: never.
        self.local_prefill_wait = (local_prefill_wait if local_prefill_wait is not None
                                   and math.isfinite(local_prefill_wait) and not colocated else None)
        #: A decode replica's local prefill chunk is cut so its step stays within this fraction of
        #: the ITL target (a token budget set from the TBT target, as Sarathi-Serve's); None: the
        #: token budget alone, as a colocated replica.
        self.local_chunk_itl = local_chunk_itl
        #: A colocated replica's prompt chunk is cut so its step (decode batch, host and chunk) stays
        #: within this many seconds, at least 16 tokens (the served app's: its replicas are decode
        #: replicas prefilling locally, their ChunkSizer aiming at local_prefill_itl_share of
        #: target_itl_s); None: the token budget alone.
        self.chunk_step_s = chunk_step_s
        self.failed = 0
        self.handle_queue: deque[int] = deque()
        self.handle_tokens = 0.0  # prompt tokens of the requests waiting at the prefill handle
        n = len(requests["arrival"])
        self.local = np.zeros(n, dtype=bool)  # prefilled on its decode replica
        self.state = np.full(n, -1)  # -1: not arrived
        self.decode_of = np.full(n, -1)
        self.generated = np.zeros(n)
        self.first_token = np.full(n, np.nan)
        self.finished = np.full(n, np.nan)
        self.ready = np.full(n, np.inf)  # transfer done
        self.prefill_start = np.full(n, np.nan)
        self.prefill_done = np.full(n, np.nan)  # the step computing the prompt's end ended
        self.enqueued = np.full(n, np.nan)  # joined a prefill queue (after the decode admitted it)
        self.replicas: list[Replica] = []
        self.gpus = gpus if gpus is not None else (decode if colocated else prefill + decode)
        for _ in range(decode):
            self.replicas.append(Replica("colocated" if colocated else "decode", 0.0))
        for _ in range(0 if colocated else prefill):
            self.replicas.append(Replica("prefill", 0.0))
        self.waiting: deque[int] = deque()
        self.itl_hist = np.zeros(400)  # ITL histogram, log bins from 0.1 ms to 10 s
        #: Decode steps per streamed gap, per request, where the workload says how many text
        #: chunks each request's stream carries (``requests["chunks"]``: a token whose text is
        #: not yet whole, a byte of a multi-byte character, streams nothing and its step merges
        #: into the next chunk's gap). Which tokens carry text is the output's, not the server's,
        #: and it is bimodal: most requests stream a chunk a token, a few one every two or more.
        #: None: every request streams as ``Costs.textless_token_share`` says.
        self.gap_steps = gap_steps(requests["output"], requests["chunks"]) if "chunks" in requests else None
        # what the replicas report (cluster.decode.server: TTFT at each first token, ITL per step):
        # (t, ttft, prefill queue) per first token and (t, the worst replica's step) per tick
        self.recent: deque[tuple[float, float, float]] = deque()
        self.recent_itl: deque[tuple[float, float]] = deque()
        self.timeline: list[dict[str, Any]] = []
        self.planner_state = PlannerState()
        #: Each replica's latest decode step (s) and the share of it its GPU was busy.
        self.last_step = np.full(len(self.replicas), self.c.step_overhead_s)
        self.decode_gpu_share = 0.0

    # --- helpers ---
    def _ready(self, role: str, now: float) -> list[int]:
        return [i for i, x in enumerate(self.replicas) if x.role == role and x.ready_at <= now and not x.draining]

    def _itl_bin(self, seconds: np.ndarray) -> np.ndarray:
        return np.clip(((np.log10(np.maximum(seconds, 1e-4)) + 4) * 80).astype(int), 0, 399)

    def _admit(self, now: float) -> None:
        """Waiting requests to a decode replica with room (most free KV), then a prefill queue."""
        role = "colocated" if self.colocated else "decode"
        decodes = self._ready(role, now)
        prefills = decodes if self.colocated else self._ready("prefill", now)
        if not decodes or (not prefills and self.local_prefill_wait is None):
            return
        self._dispatch(prefills, now)
        free = np.array([self.c.kv_tokens - self.replicas[i].kv_used for i in decodes])
        live = (self.state >= PREFILL) & (self.state < DONE)
        seqs = np.bincount(self.decode_of[live], minlength=len(self.replicas))
        for _ in range(len(self.waiting)):
            rid = self.waiting[0]
            need = float(self.r["prompt"][rid] + self.r["output"][rid])
            j = int(np.argmax(free))
            d = decodes[j]
            if free[j] < need or seqs[d] >= self.c.max_num_seqs:
                break  # FIFO: the head waits for room
            self.waiting.popleft()
            free[j] -= need
            seqs[d] += 1
            self.replicas[d].kv_used += need
            self.decode_of[rid] = d
            self.enqueued[rid] = now
            self.state[rid] = PREFILL
            if self.colocated:
                self._enqueue(d, rid)
            elif self._prefill_locally(d, prefills, rid):
                self.local[rid] = True
                self._enqueue(d, rid)
            else:
                self.handle_queue.append(rid)
                self.handle_tokens += float(self.r["prompt"][rid])
                self._dispatch(prefills, now)

    def _prefill_locally(self, d: int, prefills: list[int], rid: int) -> bool:
        """The prefill pool is saturated: its expected wait (queued prompt tokens, at the handle
        and on the ready prefill replicas, over their prefill rate at this prompt's length) exceeds
        ``local_prefill_wait`` x the TTFT target, and the decode replica's own queue is shorter."""
        if self.local_prefill_wait is None:
            return False
        per_token = self.c.prefill_seconds(1.0, float(self.r["prompt"][rid]))
        if not prefills:
            return True
        queued = self.handle_tokens + sum(self.replicas[i].queued_tokens for i in prefills)
        pool_wait = queued * per_token / len(prefills)
        if pool_wait <= self.local_prefill_wait * self.ttft_target:
            return False
        return self.replicas[d].queued_tokens * per_token < pool_wait

    def _enqueue(self, p: int, rid: int) -> None:
        rep = self.replicas[p]
        rep.queue.append(rid)
        rep.queued_tokens += float(self.r["prompt"][rid])

    def _dispatch(self, prefills: list[int], now: float) -> None:
        """Requests at the handle to the prefill replica with the fewest queued tokens and room."""
        while self.handle_queue and prefills:
            room = [i for i in prefills if len(self.replicas[i].queue) < self.prefill_max_ongoing]
            if not room:
                return
            rid = self.handle_queue.popleft()
            self.handle_tokens -= float(self.r["prompt"][rid])
            self._enqueue(min(room, key=lambda i: self.replicas[i].queued_tokens), rid)

    def _complete_prefill(self, rep: Replica, rid: int, done_at: float) -> None:
        self.prefill_done[rid] = done_at
        prompt = float(self.r["prompt"][rid])
        landed = done_at if rep.role != "prefill" else done_at + self.c.transfer_seconds(prompt)
        self.first_token[rid] = landed + self.c.first_token_delay(float(self.last_step[self.decode_of[rid]]))
        self.ready[rid] = self.first_token[rid]
        self.state[rid] = TRANSFER
        self.generated[rid] = 1.0

    def _stamp_reached(self, rep: Replica, tokens: float, at: float) -> None:
        """A step of ``tokens`` prompt tokens begins at ``at``: every queued prompt it reaches is
        scheduled then (as the engine stamps a step's prompts when it begins)."""
        reach = tokens + rep.head_done
        for rid in rep.queue:
            if reach <= 1e-9:
                break
            if np.isnan(self.prefill_start[rid]):
                self.prefill_start[rid] = at
            reach -= float(self.r["prompt"][rid])

    def _prefill_steps(self, rep: Replica, seconds: float, now: float) -> float:
        """``_prefill`` in steps of up to the token budget (``prefill_steps``)."""
        used = 0.0
        while used < seconds and (rep.queue or rep.step_done):
            if rep.step_left <= 0.0 and not rep.step_done:  # a new step, from the queue as it is now
                rep.step_left = min(float(self.c.max_batched_tokens), rep.queued_tokens)
                self._stamp_reached(rep, rep.step_left, now + used)
            if rep.queue and rep.step_left > 1e-9:
                rid = rep.queue[0]  # stamped when its step began
                prompt = float(self.r["prompt"][rid])
                take = min(prompt - rep.head_done, rep.step_left)
                per_token = self.c.prefill_seconds(1.0, prompt)
                can = (seconds - used) / per_token
                if can < take:
                    rep.head_done += can
                    rep.queued_tokens -= can
                    rep.step_left -= can
                    return seconds
                used += take * per_token
                rep.head_done += take
                rep.queued_tokens -= take
                rep.step_left -= take
                if rep.head_done >= prompt - 1e-9:
                    rep.queue.popleft()
                    rep.head_done = 0.0
                    rep.step_done.append(rid)
                if rep.step_left > 1e-9 and rep.queue:
                    continue
            if rep.overhead_left < 0.0:  # the step's own overhead, once
                rep.overhead_left = self.c.prefill_overhead_s
            spend = min(seconds - used, rep.overhead_left)
            used += spend
            rep.overhead_left -= spend
            if rep.overhead_left > 1e-12:
                return seconds
            for rid in rep.step_done:
                self._complete_prefill(rep, rid, now + used)
            rep.step_done, rep.step_left, rep.overhead_left = [], 0.0, -1.0
        return used

    def _prefill(self, rep: Replica, seconds: float, now: float) -> float:
        """Run ``seconds`` of prefill on ``rep``'s FIFO; returns the seconds used."""
        if self.prefill_steps and rep.role == "prefill":
            return self._prefill_steps(rep, seconds, now)
        used = 0.0
        while rep.queue:
            rid = rep.queue[0]
            prompt = float(self.r["prompt"][rid])
            left = prompt - rep.head_done
            if used >= seconds and left > TOKEN_EPS:  # (a head computed but for rounding completes)
                break
            if np.isnan(self.prefill_start[rid]):
                self.prefill_start[rid] = now + used
            per_token = self.c.prefill_seconds(1.0, prompt)
            can = (seconds - used) / per_token
            if can < left and left > TOKEN_EPS:
                rep.head_done += can
                rep.queued_tokens -= can
                return seconds
            used += left * per_token + self.c.prefill_overhead_s
            rep.queue.popleft()
            rep.queued_tokens -= left
            rep.head_done = 0.0
            self._complete_prefill(rep, rid, now + used)
        return used

    def step(self, now: float) -> None:
        dt = self.dt
        arrived = (self.state == -1) & (self.r["arrival"] <= now)
        for rid in np.flatnonzero(arrived):
            self.state[rid] = WAIT
            self.waiting.append(int(rid))
        self._admit(now)
        # prefill work (prefill replicas, or the prefill part of colocated ones)
        if len(self.last_step) < len(self.replicas):
            self.last_step = np.pad(self.last_step, (0, len(self.replicas) - len(self.last_step)),
                                    constant_values=self.c.step_overhead_s)
        prefill_time = np.zeros(len(self.replicas))
        for i, rep in enumerate(self.replicas):
            if rep.role == "prefill" and (rep.queue or rep.step_done):
                # one GPU time-sliced between the two replicas: prefill gets what decode leaves, at least half
                share = max(0.5, 1.0 - self.decode_gpu_share) if self.shared_gpu else 1.0
                prefill_time[i] = self._prefill(rep, dt * share, now)
        moved = (self.state == TRANSFER) & (self.ready <= now + dt)
        self.state[moved] = DECODE
        for rid in np.flatnonzero(moved):
            # the prefill queue as the prefill worker measures it: its own, not the wait for decode room
            self.recent.append((now, float(self.first_token[rid] - self.r["arrival"][rid]),
                                float(self.prefill_start[rid] - self.enqueued[rid])))
        active = np.flatnonzero(self.state == DECODE)
        reps = self.decode_of[active]
        n = len(self.replicas)
        batch = np.bincount(reps, minlength=n).astype(float)
        ctx = np.bincount(reps, weights=self.r["prompt"][active] + self.generated[active], minlength=n)
        gpu, host = self.c.decode_parts(batch, ctx)
        if self.shared_gpu:  # the decode replica's GPU work waits for the prefill's time slices
            slowed = 1.0 / (1.0 - min(0.5, prefill_time.sum() / dt))
            gpu = gpu * slowed
            if not self.c.host_overlaps_gpu:  # one CPU machine: the host's work shares its cores too
                host = host * slowed
        step = np.where(batch > 0, self.c.combine(gpu, host), self.c.step_overhead_s)
        # the decode loop's turns (a first token's path) last a decode step, not a prefill chunk's
        self.last_step = np.where(batch > 0, step, self.last_step)
        # each step of a colocated replica, or of a decode replica prefilling locally, also carries
        # a prefill chunk filling the token budget: decided as the engine step begins, from the
        # queue as it is then, and kept until the step ends (``_chunk_step``)
        for i, rep in enumerate(self.replicas):
            if rep.queue and rep.role in ("colocated", "decode"):
                step[i] = self._chunk_steps(rep, now, float(batch[i]), float(gpu[i]), float(host[i]), float(step[i]))
        if now >= self._next_cap_sample:
            self._next_cap_sample += CAP_SAMPLE_S
            caps = [self._replayed_cap(now) if self.chunk_caps is not None else float(rep.sizer.cap)
                    for rep in self.replicas if rep.role == "colocated" and (rep.sizer or self.chunk_caps)]
            if caps:
                self.cap_samples.append((now, float(np.mean(caps))))
        busy = batch > 0
        if busy.any():
            self.recent_itl.append((now, float(step[busy].max())))
        self.decode_gpu_share = float(np.max(gpu[busy] / step[busy])) if self.shared_gpu and busy.any() else 0.0
        if active.size:
            steps = dt / step
            gain = steps[reps]
            self.generated[active] += gain
            if self.gap_steps is not None:  # a request's gaps span k steps: floor(k) or floor(k) + 1
                k = self.gap_steps[active]
                low = np.floor(k)
                gaps = gain / k
                np.add.at(self.itl_hist, self._itl_bin(low * step[reps]), gaps * (1.0 - (k - low)))
                np.add.at(self.itl_hist, self._itl_bin((low + 1.0) * step[reps]), gaps * (k - low))
            else:
                q = self.c.textless_token_share  # a text chunk per token, but for the textless
                # ones, whose gaps merge with the next token's: of a token's (1 - q) chunks, q span two
                np.add.at(self.itl_hist, self._itl_bin(step[reps]), gain * (1.0 - 2.0 * q))
                if q > 0:
                    np.add.at(self.itl_hist, self._itl_bin(2.0 * step[reps]), gain * q)
            done = self.generated[active] >= self.r["output"][active]
            for rid in active[done]:
                over = (self.generated[rid] - self.r["output"][rid]) / max(gain[np.searchsorted(active, rid)], 1e-9)
                self.finished[rid] = now + dt * (1 - over)
                self.state[rid] = DONE
                self.replicas[self.decode_of[rid]].kv_used -= float(self.r["prompt"][rid] + self.r["output"][rid])
                self._next_client_request(float(self.finished[rid]))

    def _chunk_step(self, rep: Replica, batch: float, gpu: float, host: float, now: float) -> None:
        """A new engine step of ``rep`` (colocated, or a decode replica prefilling locally) begins:
        its prompt chunk from the queue as it is now (the budget beside ``batch`` decoding requests,
        the cap), whether the cap bounded it, and every prompt it reaches stamped as scheduled (as
        the engine stamps a step's prompts when it begins). The engine's ``ChunkSizer`` learns from
        the step when it carries decoding requests too (timing its compute)."""
        chunk = max(0.0, min(self.c.max_batched_tokens - batch, rep.queued_tokens))
        head = float(self.r["prompt"][rep.queue[0]])
        if rep.role == "decode" and self.local_chunk_itl is not None:
            room = self.local_chunk_itl * self.itl_target - gpu * (batch > 0)
            chunk = min(chunk, max(64.0, room / self.c.prefill_seconds(1.0, head)))
        bounded = False
        if rep.role == "colocated" and self.chunk_caps is not None:
            chunk, bounded = self._capped_chunks(rep, chunk, self._replayed_cap(now))
        elif rep.role == "colocated" and self.chunk_step_s is not None:
            if self.chunk_sizer:  # the engine's own sizer: what it has learned so far
                if rep.sizer is None:
                    rep.sizer = (ChunkSizer(self.chunk_step_s, self.c.max_batched_tokens)
                                 if self.chunk_sizer_cap is None else
                                 ChunkSizer(self.chunk_step_s, self.c.max_batched_tokens, initial=self.chunk_sizer_cap))
                chunk, bounded = self._capped_chunks(rep, chunk, float(rep.sizer.cap))
            else:  # the tokens that fill the target exactly
                chunk = min(chunk, max(16.0, self.c.chunk_tokens(self.chunk_step_s, batch, gpu, host, head)))
        self._stamp_reached(rep, chunk, now)
        rep.chunk, rep.chunk_head, rep.chunk_left = chunk, head, 1.0
        if rep.sizer is not None and batch > 0:
            compute = self.c.chunk_step_compute(batch, gpu, chunk, head)
            rep.sizer.observe(int(round(chunk)), bounded, float(compute))

    def _chunk_steps(self, rep: Replica, now: float, batch: float, gpu: float, host: float,
                     decode_step: float) -> float:
        """This tick's engine steps of ``rep`` that carry prompt chunks (each chunk fixed from its
        step's start, ``_chunk_step``), then decode-only steps once the queue is empty; returns
        the tick's mean step time (what each decoding request's progress divides by)."""
        remaining, steps = self.dt, 0.0
        while remaining > 1e-12 and (rep.queue or rep.chunk_left > 1e-9):
            if rep.chunk_left <= 1e-9:
                self._chunk_step(rep, batch, gpu, host, now + self.dt - remaining)
            chunk_s = self.c.prefill_seconds(rep.chunk, rep.chunk_head)  # the step's progress, in prefill seconds
            if rep.role == "colocated":
                compute = self.c.chunk_step_compute(batch, gpu, rep.chunk, rep.chunk_head)
            else:
                compute = gpu * (batch > 0) + chunk_s
            with_chunk = float(self.c.combine(np.asarray(compute), np.asarray(host)))
            part = min(rep.chunk_left, remaining / with_chunk)
            if rep.queue:
                self._prefill(rep, part * chunk_s, now + self.dt - remaining)
            rep.chunk_left -= part
            if rep.chunk_left <= 1e-9 or not rep.queue:  # the step's prompt tokens are all computed
                rep.chunk_left = 0.0
            remaining -= part * with_chunk
            steps += part
        steps += remaining / decode_step
        return self.dt / steps

    def _capped_chunks(self, rep: Replica, room: float, cap: float) -> tuple[float, bool]:
        """The prompt tokens a colocated step carries under the cap, as the engine's scheduler
        applies it, and whether the cap bounded the step: only such a step teaches the engine's
        ``ChunkSizer`` (``StepLoop._size_chunks``). ``room``: the queued prompt tokens the step's
        budget leaves room for beside its decoding requests, as the step begins (the queue head's
        tokens not yet computed). With ``chunks_per_step`` (the served default,
        ``Scheduler.step_prompt_cap``) the cap bounds the step's prompt tokens together, and
        the step was bounded when they reached it; otherwise (``Scheduler.chunk_cap``) the step
        packs prompts in order, each at most the cap, and it was bounded when some prompt was cut
        at the cap, so a cap above every prompt stops growing."""
        if self.chunks_per_step:
            total = min(room, cap)
            return total, total >= cap
        total, bounded = 0.0, False
        for j, rid in enumerate(rep.queue):
            if total >= room:
                break
            prompt = float(self.r["prompt"][rid])
            left = prompt - rep.head_done if j == 0 else prompt
            take = min(left, cap, room - total)
            bounded = bounded or (left > cap and take >= cap)
            total += take
        return total, bounded

    def _replayed_cap(self, now: float) -> float:
        """The replayed served cap at ``now`` (``chunk_caps``)."""
        assert self.chunk_caps is not None
        i = bisect.bisect_right(self.chunk_caps, (now, math.inf)) - 1
        return self.chunk_caps[i][1] if i >= 0 else float(ChunkSizer(1.0, self.c.max_batched_tokens).cap)

    def _next_client_request(self, at: float) -> None:
        """Closed loop: a client whose request ended sends its next one."""
        if self.pending:
            self.r["arrival"][self.pending.popleft()] = at

    # --- the planner loop ---
    def observe(self, now: float, window: float = 30.0) -> Observation:
        for q in (self.recent, self.recent_itl):
            while q and q[0][0] < now - window:
                q.popleft()
        firsts = np.array([x[1:] for x in self.recent]) if self.recent else np.zeros((0, 2))
        ttft_p90, queue_p90 = np.percentile(firsts, 90, axis=0) if len(firsts) else (0.0, 0.0)
        itl_p90 = float(np.percentile([x[1] for x in self.recent_itl], 90)) if self.recent_itl else 0.0
        dec = [x for x in self.replicas if x.role == "decode" and not x.draining]
        pre = [x for x in self.replicas if x.role == "prefill" and not x.draining]
        ready_d = [x for x in dec if x.ready_at <= now]
        ready_p = [x for x in pre if x.ready_at <= now]
        kv = max((x.kv_used / self.c.kv_tokens for x in ready_d), default=0.0)
        decode = RoleLoad(len(dec), len(ready_d), bool(ready_d), len(self.waiting) / max(1, len(ready_d)), kv)
        waiting_p = (sum(len(x.queue) for x in ready_p) + len(self.handle_queue)) / max(1, len(ready_p))
        prefill = RoleLoad(len(pre), len(ready_p), bool(ready_p), waiting_p, 0.0)
        return Observation(decode=decode, prefill=prefill, ttft_s=float(ttft_p90), itl_s=itl_p90,
                           prefill_queue_s=float(queue_p90), demand=self.demand(now, self.demand_window))

    def demand(self, now: float, window: float) -> Demand | None:
        """Arrivals over the window: rate, mean prompt and mean output tokens."""
        a = self.r["arrival"]
        seen = (a > now - window) & (a <= now)
        if not seen.any():
            return None
        # output: the arrivals' max_tokens as the router reads them (here each request's own length)
        span = min(window, now)
        return Demand(float(seen.sum()) / span, float(self.r["prompt"][seen].mean()),
                      float(self.r["output"][seen].mean()), arrival_rate_cv2(a[seen].tolist(), now, span))

    def apply(self, want: dict[str, int], now: float) -> None:
        """Serve's side of a decision: new replicas start once a GPU is free (then serve after
        ``startup_s``), removed ones drain first (the least loaded; one not yet serving first)."""
        for role in ("prefill", "decode"):
            live = [x for x in self.replicas if x.role == role and not x.draining]
            for _ in range(want[role] - len(live)):
                self.replicas.append(Replica(role, math.inf))
            extra = max(0, len(live) - want[role])
            for x in sorted(live, key=lambda x: (x.ready_at <= now, len(x.queue) + x.kv_used))[:extra]:
                x.draining, x.drain_since = True, now
        self._retire(now)

    def _retire(self, now: float) -> None:
        """Drained replicas (nothing queued or decoding) leave (their index stays: ids are stable);
        replicas waiting for a GPU start when one is free."""
        for i, x in enumerate(self.replicas):
            if x.draining and (x.ready_at == math.inf or (not x.queue and not x.step_done and x.kv_used <= 0.5)):
                x.role = "gone"
            elif x.draining and x.role != "gone" and now - x.drain_since >= self.graceful_shutdown_s:
                self._kill(i, now)  # Serve stops a draining replica after graceful_shutdown_timeout_s
        held = sum(1 for x in self.replicas if x.role != "gone" and x.ready_at < math.inf)
        for x in self.replicas:
            if x.role != "gone" and x.ready_at == math.inf and held < self.gpus:
                x.ready_at = now + self.c.startup_s
                held += 1

    def _kill(self, i: int, now: float) -> None:
        """A replica stopped with work on it: its unfinished requests fail (their streams error)."""
        x = self.replicas[i]
        mine = (self.state >= PREFILL) & (self.state < DONE)
        if x.role in ("decode", "colocated"):
            mine &= self.decode_of == i
        else:
            mine &= np.isin(np.arange(len(self.state)), list(x.queue) + list(x.step_done))
        lost = set(np.flatnonzero(mine).tolist())
        if x.role == "prefill":  # its queue's requests fail; their decode replicas free the KV
            for rid in lost:
                self.replicas[self.decode_of[rid]].kv_used -= float(self.r["prompt"][rid] + self.r["output"][rid])
        for rep in self.replicas:
            if rep.queue and any(rid in lost for rid in rep.queue):
                if rep.queue[0] in lost:
                    rep.head_done = 0.0
                rep.queue = deque(r for r in rep.queue if r not in lost)
                rep.queued_tokens = float(sum(self.r["prompt"][r] for r in rep.queue)) - rep.head_done
        self.handle_queue = deque(r for r in self.handle_queue if r not in lost)
        self.handle_tokens = float(sum(self.r["prompt"][r] for r in self.handle_queue))
        for rid in lost:
            self.state[rid] = DONE  # finished stays NaN: failed
            self._next_client_request(now)
        self.failed += len(lost)
        x.role, x.queue, x.kv_used, x.step_done = "gone", deque(), 0.0, []

    def run(self) -> dict[str, Any]:
        end = float(self.r["arrival"].max()) + 120.0 if len(self.r["arrival"]) else 0.0
        if self.concurrency is not None:
            end = self.max_time  # arrivals happen as requests end; stops when all are done
        now, next_plan = 0.0, self.interval
        while now < end:
            self.step(now)
            now += self.dt
            if now >= next_plan:
                next_plan += self.interval
                self._retire(now)
                obs = self.observe(now)
                reason = ""
                if self.settings is not None:
                    decision = plan(obs, self.settings, self.planner_state, now)
                    self.planner_state = decision.state
                    reason = decision.reason
                    if decision.reason:
                        self.apply(decision.replicas, now)
                counts = {role: sum(1 for x in self.replicas if x.role == role and not x.draining)
                          for role in ("prefill", "decode", "colocated")}
                self.timeline.append({"t": round(now, 1), **counts, "ttft_p90": round(obs.ttft_s, 4),
                                      "itl_p90": round(obs.itl_s, 5), "waiting": len(self.waiting),
                                      "prefill_queue_p90": round(obs.prefill_queue_s, 3),
                                      "kv_max": round(obs.decode.kv_usage, 3),
                                      "prefill_ready": obs.prefill.ready_replicas if obs.prefill else 0,
                                      "decode_ready": obs.decode.ready_replicas,
                                      "draining": sum(1 for x in self.replicas if x.draining and x.role != "gone"),
                                      "gpus_held": sum(1 for x in self.replicas
                                                       if x.role != "gone" and x.ready_at < math.inf),
                                      **({"reason": reason} if reason else {})})
            if not (self.state < DONE).any() and now > float(self.r["arrival"].max()):
                break  # (closed loop: every arrival is finite once the last request has ended)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        r = self.r
        ttft = self.first_token - r["arrival"]
        tpot = (self.finished - self.first_token) / np.maximum(1, r["output"] - 1)
        ok = (ttft <= self.ttft_target) & (tpot <= self.itl_target)
        phases = []
        for p in np.unique(r["phase"]):
            m = r["phase"] == p
            span = float(r["arrival"][m].max() - r["arrival"][m].min()) if m.sum() > 1 else 1.0
            phases.append({"phase": int(p), "requests": int(m.sum()), "completed": int(np.isfinite(self.finished[m]).sum()),
                           "goodput_rps": float(ok[m].sum() / span), "goodput_fraction": float(ok[m].mean()),
                           "local_prefills": int(self.local[m].sum()),
                           "ttft_p50": _pct(ttft[m], 50), "ttft_p90": _pct(ttft[m], 90),
                           "tpot_p50": _pct(tpot[m], 50), "tpot_p90": _pct(tpot[m], 90)})
        hist = spread_histogram(self.itl_hist, self.c.gap_spread_bins, self.c.gap_spread_weights)
        cdf = np.cumsum(hist) / max(hist.sum(), 1e-9)
        edges = 10 ** (np.arange(400) / 80 - 4)
        return {"requests": int(len(ttft)), "completed": int(np.isfinite(self.finished).sum()), "failed": self.failed,
                "local_prefills": int(self.local.sum()),
                "goodput_fraction": float(ok.mean()) if len(ok) else 0.0,
                "ttft_p50": _pct(ttft, 50), "ttft_p90": _pct(ttft, 90), "tpot_p50": _pct(tpot, 50),
                "itl_p50": float(edges[np.searchsorted(cdf, 0.5)]), "itl_p90": float(edges[np.searchsorted(cdf, 0.9)]),
                "itl_p99": float(edges[min(399, np.searchsorted(cdf, 0.99))]),
                "tokens_over_itl_target": float(hist[edges > self.itl_target].sum() / max(hist.sum(), 1e-9)),
                "phases": phases, "timeline": self.timeline}


def _optional_float(text: str) -> float | None:
    return None if text.lower() in ("none", "inf", "off") else float(text)


def _pct(x: np.ndarray, q: float) -> float | None:
    x = x[np.isfinite(x)]
    return float(np.percentile(x, q)) if len(x) else None


# --- experiments -----------------------------------------------------------------------------------

def serve_run_requests(cfg: dict[str, Any], rate: float, seed: int = 1) -> dict[str, np.ndarray]:
    """The serving benchmark's workload: Poisson arrivals, lengths uniform within +-range."""
    rng = np.random.default_rng(seed)
    n = int(cfg["num_requests"])
    arrival = np.cumsum(rng.exponential(1.0 / rate, n))
    def lengths(mean: int, spread: float) -> np.ndarray:
        return rng.integers(int(mean * (1 - spread)), int(mean * (1 + spread)) + 1, n)
    return {"arrival": arrival, "prompt": lengths(cfg["input_len"], cfg["input_len_range"]),
            "output": lengths(cfg["output_len"], cfg["output_len_range"]), "phase": np.zeros(n, dtype=int)}


def mix_means(mix: str, max_len: int = 16384, n: int = 200_000) -> tuple[float, float]:
    """Mean prompt and output tokens of ``mix`` as ``make_requests`` draws them (lognormal around
    the nominal means, clipped): the lognormal's mean is ~13% over its median."""
    rng = np.random.default_rng(12345)
    p_mean, o_mean = MIXES[mix]
    prompt = np.clip(rng.lognormal(math.log(p_mean), 0.5, n), 16, max_len // 2).astype(np.int64)
    out = np.clip(rng.lognormal(math.log(o_mean), 0.5, n), 8, max_len // 2).astype(np.int64)
    return float(prompt.mean()), float(out.mean())


def split_capacity(costs: Costs, mix: str, gpus: int, ttft: float, itl: float) -> dict[str, Any]:
    """Requests per second each fixed split of ``gpus`` sustains on ``mix`` in the fitted cost
    model: the lesser of its prefill replicas' rate (one prompt's prefill seconds, over the mix's
    prompt lengths) and its decode replicas' (the profiled decode tokens/s within the ITL and TTFT
    targets over the mix's mean output)."""
    prompt, out = mix_means(mix)
    rng = np.random.default_rng(54321)
    prompts = np.clip(rng.lognormal(math.log(MIXES[mix][0]), 0.5, 20_000), 16, 8192)
    prefill_s = float(np.mean([costs.prefill_seconds(p, p) for p in prompts])) + costs.prefill_overhead_s
    per_prefill = 1.0 / prefill_s
    per_decode = profile(costs, itl, ttft, int(prompt), int(out)).decode_tokens_per_s / out
    caps = {p: min(p * per_prefill, (gpus - p) * per_decode) for p in fixed_splits(gpus)}
    best = max(caps, key=lambda p: caps[p])
    return {"mean_prompt": prompt, "mean_output": out, "prefill_rps_per_replica": per_prefill,
            "decode_rps_per_replica": per_decode, "split_rps": {f"{p}p{gpus - p}d": c for p, c in caps.items()},
            "best_split": f"{best}p{gpus - best}d", "best_rps": caps[best]}


def fixed_splits(gpus: int) -> list[int]:
    return sorted({max(1, min(gpus - 1, round(gpus * f))) for f in (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)})


def profile(costs: Costs, itl_target: float, ttft_target: float, prompt: int = 2048,
            output: int = 256) -> PlannerSettings:
    """The planner's per-replica capacities as an offline profile gives them (Dynamo's profiler, in
    the cost model): prefill tokens per second at ``prompt`` tokens; decode tokens per second at
    the largest batch whose step meets the ITL target and leaves half the TTFT target to prefill
    (a first token waits ``first_token_steps`` decode steps); a decode replica's KV tokens."""
    batch = np.arange(1, costs.max_num_seqs + 1, dtype=float)
    step = costs.decode_step(batch, batch * (prompt + output / 2))
    limit = itl_target
    if costs.first_token_steps > 0:
        limit = min(limit, max(0.0, ttft_target / 2 - costs.ttft_fixed_s) / costs.first_token_steps)
    fits = batch[step <= limit]
    best = float(fits.max()) if len(fits) else 1.0
    best_step = float(costs.decode_step(np.array([best]), np.array([best * (prompt + output / 2)]))[0])
    return PlannerSettings(prefill_tokens_per_s=1.0 / costs.prefill_seconds(1.0, prompt),
                           decode_tokens_per_s=best / best_step, decode_kv_tokens=costs.kv_tokens)


def colocated_chunk_step(args: argparse.Namespace) -> float | None:
    """The colocated replicas' prompt-chunk step target (``Simulation.chunk_step_s``): the served
    app's colocated layout is decode replicas prefilling every prompt locally, whose chunk sizer
    aims at ``local_prefill_itl_share`` of the ITL target, as ``--local-chunk-itl`` models for the
    disaggregated decode replicas; ``--colocated-chunk-step`` overrides it (None: the token
    budget alone, as the comparisons before it)."""
    if args.colocated_chunk_step is not None:
        return None if args.colocated_chunk_step == "none" else float(args.colocated_chunk_step)
    return None if args.local_chunk_itl is None else args.local_chunk_itl * args.itl


def compare(args: argparse.Namespace, costs: Costs) -> dict[str, Any]:
    """The planner (the project's ``plan`` with demand and the profile: predictive sizing, reactive
    rules as backstop; and without the profile: reactive rules alone) runs the phases back to back
    on one cluster. Every fixed split, and colocated, runs each phase alone on a fresh cluster
    (the phase's own requests): the split one would deploy for that phase in hindsight, with no
    backlog carried from a phase it was never chosen for. Each phase's rate is ``load`` x what the
    best fixed split sustains on its mix in the cost model (``split_capacity``)."""
    out: dict[str, Any] = {"benchmark": "simulator-planner", "environment": environment(),
                           "costs": dataclasses.asdict(costs), "targets": {"ttft_s": args.ttft, "itl_s": args.itl},
                           "method": {"load": args.load, "phase_s": args.phase_s, "interval_s": args.interval,
                                      "planner": "phases back to back on one cluster, from gpus//4 prefill",
                                      "fixed_and_colocated": "each phase alone on a fresh cluster",
                                      "rates": "load x the best fixed split's capacity on the phase's mix "
                                               "(split_capacity, in the fitted cost model)",
                                      "goodput": "requests of the phase meeting TTFT and TPOT targets per second",
                                      "local_prefill_wait": args.local_prefill_wait,
                                      "local_chunk_itl": args.local_chunk_itl,
                                      "local_prefill": "disaggregated runs (planner and fixed splits): a request whose "
                                                       "expected prefill-pool wait exceeds local_prefill_wait x the TTFT "
                                                       "target is prefilled on its decode replica (None: never)",
                                      "command": " ".join(sys.argv),
                                      "violation_minutes": "planning intervals with p90 TTFT or ITL (last 30 s) "
                                                           "over target, until the last phase ends"},
                           "by_gpus": {}}
    mixes = args.mixes.split(",")
    colocated_chunk = colocated_chunk_step(args)
    out["method"]["colocated_chunk_step_s"] = colocated_chunk
    for gpus in [int(g) for g in args.gpus.split(",")]:
        caps = {m: split_capacity(costs, m, gpus, args.ttft, args.itl) for m in mixes}
        phases = [Phase(args.phase_s, args.load * caps[m]["best_rps"], m, bursty=(i == 1 and args.bursty))
                  for i, m in enumerate(mixes)]
        reqs = make_requests(phases, seed=args.seed)
        starts = np.cumsum([0.0] + [ph.seconds for ph in phases])
        dt = args.dt if gpus <= 8 else max(args.dt, args.dt_large)
        started = time.perf_counter()
        p0 = max(1, gpus // 4)
        settings = dataclasses.replace(
            profile(costs, args.itl, args.ttft), target_ttft_s=args.ttft, target_itl_s=args.itl, min_prefill=1,
            max_prefill=gpus - 1, min_decode=1, max_decode=gpus - 1, max_total_replicas=gpus,
            initial_prefill=p0, initial_decode=gpus - p0, handover_starting_share=args.handover_starting_share,
            downscale_window_s=args.downscale_window, hold_budget=args.hold_budget == "on")
        planners = {"planner": settings}
        if args.reactive or args.both:
            reactive = dataclasses.replace(settings, prefill_tokens_per_s=None, decode_tokens_per_s=None)
            planners = {"planner-reactive": reactive} if args.reactive else {**planners, "planner-reactive": reactive}
        common = dict(dt=dt, interval_s=args.interval, ttft_target=args.ttft, itl_target=args.itl, gpus=gpus,
                      local_prefill_wait=args.local_prefill_wait, local_chunk_itl=args.local_chunk_itl)
        runs: dict[str, Any] = {}
        for name, s in planners.items():
            runs[name] = Simulation(costs, reqs, prefill=p0, decode=gpus - p0, planner=s, **common).run()
            print(f"  {gpus} GPUs {name}: {time.perf_counter() - started:.0f} s", flush=True)
        end = float(starts[-1])
        planner_stats = {  # of the planner's runs, with or without the fixed splits
            "recovery_intervals": {k: recovery(v["timeline"], phases, args) for k, v in runs.items()},
            "reversals": {k: reversals(v["timeline"], phases) for k, v in runs.items()},
            "violation_minutes": {k: violation_minutes(v["timeline"], args, end) for k, v in runs.items()}}
        if args.planner_only:
            out["by_gpus"][str(gpus)] = {
                "phases": [{"phase": i, "mix": ph.mix, "rate_rps": ph.rate,
                            "goodput_rps": {k: v["phases"][i]["goodput_rps"] for k, v in runs.items()}}
                           for i, ph in enumerate(phases)], **planner_stats, "runs": runs}
            continue
        alone: dict[str, list[dict[str, Any]]] = {}
        for i in range(len(phases)):
            m = reqs["phase"] == i
            seg = {k: (v[m] - starts[i] if k == "arrival" else v[m]) for k, v in reqs.items()}
            for p in fixed_splits(gpus):
                alone.setdefault(f"fixed-{p}p{gpus - p}d", []).append(
                    Simulation(costs, seg, prefill=p, decode=gpus - p, **common).run())
            alone.setdefault("colocated", []).append(
                Simulation(costs, seg, prefill=0, decode=gpus, colocated=True, chunk_step_s=colocated_chunk,
                           **common).run())
            print(f"  {gpus} GPUs fixed, phase {i}: {time.perf_counter() - started:.0f} s", flush=True)
        good: list[dict[str, float]] = [{} for _ in phases]
        for k, v in runs.items():
            for i in range(len(phases)):
                good[i][k] = v["phases"][i]["goodput_rps"]
        for k, v in alone.items():
            for i in range(len(phases)):
                good[i][k] = v[i]["phases"][0]["goodput_rps"]
        fixed = [k for k in alone if k.startswith("fixed")]
        per_phase = []
        for i, ph in enumerate(phases):
            g = good[i]
            best = max(fixed, key=lambda k: g[k])
            worst = min(fixed, key=lambda k: g[k])
            row = {"phase": i, "mix": ph.mix, "rate_rps": ph.rate, "bursty": ph.bursty, "capacity": caps[ph.mix],
                   "goodput_rps": g, "best_fixed": best, "worst_fixed": worst}
            for name in runs:
                row[f"{name}_over_best"] = g[name] / g[best] if g[best] else None
                row[f"{name}_over_worst"] = g[name] / g[worst] if g[worst] else None
                row[f"{name}_over_colocated"] = g[name] / g["colocated"] if g["colocated"] else None
            per_phase.append(row)
        out["by_gpus"][str(gpus)] = {
            "phases": per_phase,
            **planner_stats,
            "violation_minutes": {**planner_stats["violation_minutes"],
                                  **{k: sum(violation_minutes(r["timeline"], args, ph.seconds) for r, ph in zip(v, phases))
                                     for k, v in alone.items()}},
            "violation_minutes_per_phase": {k: [violation_minutes(v["timeline"], args, starts[i + 1], starts[i])
                                                for i in range(len(phases))] for k, v in runs.items()},
            "runs": {k: v for k, v in runs.items()},
            "fixed_runs": {k: [{kk: vv for kk, vv in r.items() if kk != "timeline"} for r in v]
                           for k, v in alone.items()},
            "seconds": time.perf_counter() - started, "dt": dt}
        print(f"{gpus} GPUs ({time.perf_counter() - started:.0f} s):")
        for p in per_phase:
            print(f"  {p['mix']} at {p['rate_rps']:.1f} req/s: " + ", ".join(f"{k} {v:.2f}" for k, v in p["goodput_rps"].items())
                  + f"; best fixed {p['best_fixed']}", flush=True)
    return out


def recovery(timeline: list[dict[str, Any]], phases: list[Phase], args: argparse.Namespace) -> list[int | None]:
    """Per phase after a shift: the planning intervals from the shift until the p90 targets are
    met and stay met to the phase's end (None: not within the phase). The p90s are over the last
    30 s, so the first intervals after a shift still show the old phase."""
    out: list[int | None] = []
    start = phases[0].seconds
    for ph in phases[1:]:
        inside = [x for x in timeline if start < x["t"] <= start + ph.seconds]
        met = [x["ttft_p90"] <= args.ttft and x["itl_p90"] <= args.itl for x in inside]
        last_bad = max((i for i, ok in enumerate(met) if not ok), default=-1)
        out.append(last_bad + 1 if last_bad + 1 < len(met) else None)
        start += ph.seconds
    return out


def reversals(timeline: list[dict[str, Any]], phases: list[Phase]) -> dict[str, list[int]]:
    """Per role and phase: how often the replica count changed direction."""
    out: dict[str, list[int]] = {}
    for role in ("prefill", "decode"):
        counts, start = [], 0.0
        for ph in phases:
            seq = [x[role] for x in timeline if start <= x["t"] < start + ph.seconds]
            steps = [b - a for a, b in zip(seq, seq[1:]) if b != a]
            counts.append(sum(1 for a, b in zip(steps, steps[1:]) if (a > 0) != (b > 0)))
            start += ph.seconds
        out[role] = counts
    return out


def violation_minutes(timeline: list[dict[str, Any]], args: argparse.Namespace, until: float = math.inf,
                      since: float = 0.0) -> float:
    bad = sum(1 for x in timeline if since < x["t"] <= until and (x["ttft_p90"] > args.ttft or x["itl_p90"] > args.itl))
    return bad * args.interval / 60.0


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = list(result["by_gpus"])
    fig, axes = plt.subplots(2, len(sizes), figsize=(5 * len(sizes), 7), squeeze=False)
    for j, g in enumerate(sizes):
        data = result["by_gpus"][g]
        ax = axes[0][j]
        names = list(data["phases"][0]["goodput_rps"])
        for k, ph in enumerate(data["phases"]):
            ax.bar([i + 0.25 * k for i in range(len(names))], [ph["goodput_rps"][n] for n in names], 0.25,
                   label=ph["mix"])
        ax.set_xticks(range(len(names)), names, rotation=60, fontsize=7)
        ax.set_title(f"{g} GPUs: goodput (req/s) per phase")
        ax.legend(fontsize=7)
        tl = next(iter(data["runs"].values()))["timeline"]
        ax = axes[1][j]
        ax.plot([x["t"] for x in tl], [x["prefill"] for x in tl], label="prefill replicas")
        ax.plot([x["t"] for x in tl], [x["decode"] for x in tl], label="decode replicas")
        ax.set_xlabel("seconds")
        ax.set_title("planner: replicas over time")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a quick check: 8 GPUs, short phases")
    parser.add_argument("--gpus", default="8,64,512")
    parser.add_argument("--mixes", default="chat,rag,code")
    parser.add_argument("--phase-s", type=float, default=240.0)
    parser.add_argument("--load", type=float, default=0.65)
    parser.add_argument("--bursty", action="store_true", help="the second phase's arrivals come in bursts")
    parser.add_argument("--ttft", type=float, default=1.0)
    parser.add_argument("--itl", type=float, default=0.05)
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--dt", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=4, help="validation: runs per row (median)")
    parser.add_argument("--fit-iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="validation: fitting rounds")
    parser.add_argument("--fit-file", default=None, help="validation: the serving run to fit on (default: latest)")
    parser.add_argument("--reactive", action="store_true", help="the planner without its profile (reactive rules only)")
    parser.add_argument("--both", action="store_true", help="the planner with and without its profile")
    parser.add_argument("--dt-large", type=float, default=0.05, help="tick beyond 8 GPUs")
    parser.add_argument("--local-prefill-wait", type=_optional_float, default=LOCAL_PREFILL_WAIT,
                        help="prefill on the decode replica when the prefill pool's expected wait exceeds this "
                             "fraction of the TTFT target; 'none' or 'inf': never (the behaviour before it)")
    parser.add_argument("--local-chunk-itl", type=_optional_float, default=LOCAL_CHUNK_ITL,
                        help="cut a decode replica's local prefill chunks so its step stays within this fraction "
                             "of the ITL target (default: the served decode replica's local_prefill_itl_share; "
                             "'none': the token budget alone, as colocated)")
    parser.add_argument("--colocated-chunk-step", default=None,
                        help="seconds a colocated replica's step carrying prompt chunks aims at (default: "
                             "--local-chunk-itl x --itl, as the served colocated layout; 'none': the token "
                             "budget alone, as comparisons before 2026-12-06)")
    parser.add_argument("--handover-starting-share", type=_optional_float,
                        default=PlannerSettings().handover_starting_share,
                        help="the planner's handover_starting_share (default: the planner's default)")
    parser.add_argument("--downscale-window", type=float, default=PlannerSettings().downscale_window_s,
                        help="the planner's downscale_window_s (default: the planner's default; 0: off)")
    parser.add_argument("--hold-budget", choices=("on", "off"), default="on" if PlannerSettings().hold_budget else "off",
                        help="the planner's hold_budget, rule 9 (default: the planner's default)")
    parser.add_argument("--planner-only", action="store_true",
                        help="run the planner alone (no fixed splits, no comparison): for trying its settings")
    parser.add_argument("--calibration", default=None, help="a --validate result whose fitted constants to use")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.gpus, args.phase_s, args.seeds, args.fit_iters, args.rounds = "8", 60.0, 1, 4, 1
    result: dict[str, Any] = {}
    if args.validate or args.tiny:
        from bench.simulate_validation import validate
        result["validation"] = validate(args)
    if args.compare or args.tiny:
        costs = Costs.from_results()
        fitted = (result.get("validation") or {}).get("fitted")
        if args.calibration:
            with open(args.calibration) as f:
                fitted = json.load(f)["validation"]["fitted"]
        if fitted:  # host costs of the serving stack: the same Python per step and per token at any model size
            costs = dataclasses.replace(costs, **{k: v for k, v in fitted.items() if k != "prefill_flops_s"})
        result["comparison"] = compare(args, costs)
    if args.out:
        write_result(args.out, result)
        if "comparison" in result and not args.planner_only:
            plot(result["comparison"], os.path.splitext(args.out)[0] + ".png")
    return result


if __name__ == "__main__":
    main()
