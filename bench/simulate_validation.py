"""Validation of the cluster simulator (``bench/simulate.py``) against the committed single-GPU
serving runs (``serve-h200-*.json``: one H200, an 8-layer Qwen3-width model, 2,048 in / 256 out,
48 Poisson requests at 4 and 8 req/s, disaggregated (prefill and decode replicas sharing the GPU,
``num_gpus`` 0.5 each) and colocated).

What is measured elsewhere and not fitted: weight and KV bytes at the measured copy bandwidth and
decode efficiency, the prefill rate (the engine's throughput row), the KV transfer. What is fitted,
on the disaggregated rows of one run only (``--fit-file``, default the latest):
- the decode replica's host time per step, fixed and per running sequence (ITL p50 at 4 and 8
  req/s). Host and GPU overlap (pipelined decode), so a step takes the longer of the two: at 4
  req/s steps are GPU-bound, at 8 req/s the per-sequence host cost (each token a streamed item)
  caps the replica near 1/step_per_seq_s tokens per second, which is why ITL jumps;
- the first token's host path: a fixed time and a number of decode-loop turns, each as long as
  the decode replica's step then (TTFT p50 at 4 and 8 req/s).
Every other row (the colocated rows of that run, every row of the other runs, and every p90 and
goodput) is a prediction; residuals are (simulated - measured) / measured.

    python bench/simulate_validation.py --out bench/results/simulate-validation-<date>.json
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, write_result  # noqa: E402
from bench.simulate import RESULTS, Costs, Simulation, gap_spread, serve_run_requests  # noqa: E402
from cluster.config import ClusterConfig, TransferConfig  # noqa: E402
from cluster.engine.scheduler import ChunkSizer  # noqa: E402

METRICS = ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "tpot_p50", "goodput_fraction")
#: (parameter, low, high, the disaggregated rate whose metric it matches, metric)
FITS = (("step_overhead_s", 1e-5, 2e-2, 4.0, "itl_p50"), ("step_per_seq_s", 1e-6, 5e-3, 8.0, "itl_p50"),
        ("ttft_fixed_s", 1e-4, 0.2, 4.0, "ttft_p50"), ("first_token_steps", 0.05, 100.0, 8.0, "ttft_p50"))


def load_run(path: str) -> dict[str, Any]:
    with open(path) as f:
        serve = json.load(f)
    rows = {(mode, float(rate)): r for mode in ("disagg", "colocated") for rate, r in serve["modes"][mode]["runs"].items()}
    return {"file": os.path.basename(path), "serve": serve, "rows": rows}


def measured(row: dict[str, Any]) -> dict[str, float]:
    return {"ttft_p50": row["ttft_s"]["p50"], "ttft_p90": row["ttft_s"]["p90"], "itl_p50": row["itl_s"]["p50"],
            "itl_p90": row["itl_s"]["p90"], "tpot_p50": row["tpot_s"]["p50"], "goodput_fraction": row["goodput_fraction"]}


def base_costs(serve: dict[str, Any]) -> Costs:
    c = Costs.from_results(layers=int(serve["workload"]["layers"]))
    c.kv_tokens = serve["workload"]["kv_bytes"] / c.kv_bytes_per_token
    settings = serve["modes"]["disagg"]["settings"]
    c.max_batched_tokens, c.max_num_seqs = int(settings["max_num_batched_tokens"]), int(settings["max_num_seqs"])
    return c


def run_requests(cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """The requests a serving run sent, replayed from its recorded client config: the same seeded
    draws of ``bench/serve.py`` (lengths from ``seed``, Poisson arrivals from ``seed + 1``),
    warm-up requests left out."""
    from bench.serve import BenchConfig, arrival_times, request_lengths
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    config = BenchConfig(**{k: v for k, v in cfg.items() if k in fields})
    inputs, outputs = request_lengths(config)
    n = config.num_requests
    return {"arrival": np.asarray(arrival_times(config)), "prompt": np.asarray(inputs[config.warmup:]),
            "output": np.asarray(outputs[config.warmup:]), "phase": np.zeros(n, dtype=int)}


def simulate(costs: Costs, run: dict[str, Any], mode: str, rate: float, seeds: int,
             prefill_steps: bool = False) -> dict[str, float]:
    """The run's own requests (``seeds`` 0), or medians over ``seeds`` other draws of its workload."""
    cfg = run["rows"][(mode, rate)]["config"]
    wl = run["serve"]["workload"]
    draws = [run_requests(cfg)] if seeds == 0 else [serve_run_requests(cfg, rate, seed) for seed in range(seeds)]
    outs = []
    for requests in draws:
        sim = Simulation(costs, requests, prefill=1, decode=1, colocated=mode == "colocated",
                         dt=0.002, ttft_target=wl["ttft_target_s"], itl_target=wl["itl_target_s"],
                         shared_gpu=mode == "disagg", gpus=1, prefill_steps=prefill_steps)
        outs.append(sim.run())
    return {k: float(np.median([o[k] for o in outs])) for k in METRICS}


def fit_constants(costs: Costs, fits: tuple[tuple[str, float, float, Any, str], ...], args: argparse.Namespace,
                  measure: Callable[[Any], dict[str, float]],
                  simulated: Callable[[Costs, Any], dict[str, float]]) -> Costs:
    """Each constant ``(attr, low, high, row, metric)`` by bisection (geometric) until the row's
    simulated metric meets its measured one, the others held; ``args.rounds`` rounds so that
    coupled constants settle. A metric must grow with its constant."""
    for _ in range(args.rounds):
        for attr, low, high, row, metric in fits:
            want = measure(row)[metric]
            for _ in range(args.fit_iters):
                mid = math.sqrt(low * high)
                trial: dict[str, Any] = {attr: mid}
                got = simulated(dataclasses.replace(costs, **trial), row)[metric]
                low, high = (low, mid) if got > want else (mid, high)
            chosen: dict[str, Any] = {attr: math.sqrt(low * high)}
            costs = dataclasses.replace(costs, **chosen)
    return costs


def abs_residual_summary(predicted: list[float]) -> dict[str, float]:
    return {"max": max(predicted), "median": float(np.median(predicted)),
            "within_15pct": sum(r <= 0.15 for r in predicted), "of": len(predicted)}


def repeats(rows: dict[str, Any]) -> dict[str, Any]:
    """The same workload measured in several runs (``<file>:<mode>-rate<r>`` rows of one
    ``<mode>-rate<r>``): each metric's measured values, their spread ((max - min) / median: the
    run-to-run noise a single-run residual cannot be below), the simulated value against the
    runs' median, and whether it lies within the measured range. The summary counts the p50s
    that no row of the workload was fitted on."""
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for name, row in rows.items():
        by_workload.setdefault(name.split(":", 1)[1], []).append(row)
    out: dict[str, Any] = {}
    vs_median: list[float] = []
    in_range = 0
    for workload, runs in sorted(by_workload.items()):
        if len(runs) < 2:
            continue
        fitted = {m for r in runs for m in (r["fitted_on_this_row"] or [])}
        metrics: dict[str, Any] = {}
        for k in METRICS:
            values = [r["measured"][k] for r in runs]
            sims = [r["simulated"][k] for r in runs]
            median, sim = float(np.median(values)), float(np.median(sims))
            within = min(values) <= sim <= max(values)
            residual = (sim - median) / median if median else None
            metrics[k] = {"measured": values, "median": median,
                          "spread": (max(values) - min(values)) / median if median else None,
                          "simulated": sim, "residual_vs_median": residual, "within_measured_range": within,
                          "fitted_in_a_run": k in fitted}
            if k in ("ttft_p50", "itl_p50", "tpot_p50") and k not in fitted and residual is not None:
                vs_median.append(abs(residual))
                in_range += within
        out[workload] = {"runs": len(runs), "metrics": metrics}
    summary = dict(abs_residual_summary(vs_median), within_measured_range=in_range) if vs_median else None
    return {"workloads": out, "predicted_p50_vs_median_of_runs": summary}


def fit(costs: Costs, run: dict[str, Any], args: argparse.Namespace) -> Costs:
    """The GPU run's constants on its disaggregated rows (``FITS``: by request rate)."""
    return fit_constants(costs, FITS, args, lambda rate: measured(run["rows"][("disagg", rate)]),
                         lambda c, rate: simulate(c, run, "disagg", rate, args.seeds, getattr(args, "prefill_steps", False)))


def validate(args: argparse.Namespace) -> dict[str, Any]:
    paths = sorted(glob.glob(os.path.join(RESULTS, "serve-h200-*.json")))
    runs = [load_run(p) for p in paths]
    fit_run = next(r for r in runs if r["file"] == args.fit_file) if args.fit_file else runs[-1]
    costs = fit(base_costs(fit_run["serve"]), fit_run, args)
    fitted = {attr: getattr(costs, attr) for attr, *_ in FITS}
    out_rows: dict[str, Any] = {}
    predicted: list[float] = []
    for run in runs:
        run_costs = dataclasses.replace(base_costs(run["serve"]), **fitted)
        for (mode, rate), row in sorted(run["rows"].items()):
            sim = simulate(run_costs, run, mode, rate, args.seeds, getattr(args, "prefill_steps", False))
            meas = measured(row)
            residual = {k: (sim[k] - meas[k]) / meas[k] if meas[k] else None for k in METRICS}
            fitted_on = [m for _, _, _, r, m in FITS if run is fit_run and mode == "disagg" and r == rate]
            for k in ("ttft_p50", "itl_p50", "tpot_p50"):
                if k not in fitted_on and residual[k] is not None:
                    predicted.append(abs(residual[k]))
            out_rows[f"{run['file']}:{mode}-rate{rate:g}"] = {
                "commit": row.get("commit", "")[:7], "fitted_on_this_row": sorted(set(fitted_on)) or None,
                "simulated": sim, "measured": meas, "residual": residual}
            print(f"{run['file']}:{mode}-rate{rate:g}", {k: None if v is None else round(v, 3) for k, v in residual.items()})
    return {"benchmark": "simulator-validation", "environment": environment(), "fit_file": fit_run["file"],
            "fitted": fitted, "costs": dataclasses.asdict(costs),
            "predicted_p50_abs_residual": abs_residual_summary(predicted),
            "repeats": repeats(out_rows),
            "rows": out_rows,
            "note": "fitted on the disaggregated rows of fit_file (ITL p50 and TTFT p50 at 4 and 8 req/s); every "
                    "other number is a prediction. Disaggregated rows: prefill and decode replicas time-slice one "
                    "GPU (prefill gets what decode's GPU work leaves, at least half; decode's GPU part waits for "
                    "prefill's slices). Workload: " + (
                        "each row's own requests, replayed from its recorded client config (bench/serve.py's "
                        "seeded draws)" if args.seeds == 0 else
                        f"medians over {args.seeds} other draws of each row's workload, not its own draw")}


# --- the CPU serving run: closed-loop clients on one 2-core machine ---------------------------------

@dataclasses.dataclass
class CpuCosts(Costs):
    """A replica on the CPU machine. Decode steps priced from the engine's own measured step times
    by batch (``engine-cpu-*.json``, log-linear between its batches 1, 8 and 32; the KV term is
    negligible at this model's size and these contexts), plus the serving host's time per step
    (fixed and per running sequence), which does not overlap the compute: host and model share the
    same two cores. Prefill at a fitted time per prompt token, or, where the serving run timed its
    replica's steps, at their measured lines (``mixed_*``, ``prefill_*``); the disaggregated
    hand-over at a fitted fixed time."""
    step_batches: tuple[float, ...] = (1.0,)
    step_seconds: tuple[float, ...] = (0.02,)
    prefill_token_s: float = 2e-3
    #: steps that carry a prompt chunk beside decoding requests, where measured (``replica_steps``'
    #: ``mixed``): by batch, the step's fixed compute and its compute per prompt token (empty: a
    #: chunk adds ``prefill_token_s`` a token to the decode-only step)
    mixed_batches: tuple[float, ...] = ()
    mixed_base_s: tuple[float, ...] = ()
    mixed_token_s: tuple[float, ...] = ()
    #: the prefill and decode replicas compute on cores of their own (their threads fit the
    #: machine's cores, as Ray's one-thread replicas on two cores do): no time slicing between them
    own_cores: bool = False

    def decode_parts(self, batch: np.ndarray, context_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        compute = np.interp(np.log2(np.maximum(batch, 1.0)), np.log2(self.step_batches), self.step_seconds)
        return compute, self.step_overhead_s + self.step_per_seq_s * batch

    def _mixed(self, batch: float) -> tuple[float, float]:
        return (float(np.interp(batch, self.mixed_batches, self.mixed_base_s)),
                float(np.interp(batch, self.mixed_batches, self.mixed_token_s)))

    def chunk_step_compute(self, batch: float, gpu: float, chunk: float, head: float) -> float:
        if not self.mixed_batches:
            return super().chunk_step_compute(batch, gpu, chunk, head)
        base, per_token = self._mixed(batch)
        return base + per_token * chunk

    def chunk_tokens(self, target_s: float, batch: float, gpu: float, host: float, head: float) -> float:
        if not self.mixed_batches:
            return super().chunk_tokens(target_s, batch, gpu, host, head)
        base, per_token = self._mixed(batch)
        return (target_s - host - base) / per_token

    def prefill_seconds(self, tokens: float, context: float) -> float:
        return tokens * self.prefill_token_s

    def transfer_seconds(self, tokens: float) -> float:
        return self.transfer_fixed_s


#: (parameter, low, high, the row (mode, phase) whose metric it matches, metric): the host's time
#: per step from the colocated ITL at concurrency 1, per running sequence from the disaggregated
#: ITL at 8 (its decode replica only decodes; the colocated replica's steps at 8 carry prompt
#: chunks, sized to its step target, which sets their ITL whatever the host costs); a first
#: token's fixed host path and the prefill time per token from the colocated TTFT at concurrency
#: 1 (p50 and p90: the prompts are 128-384 tokens, so the p90 prices the longer ones); the
#: hand-over from the disaggregated TTFT at concurrency 1.
CPU_FITS = (("step_overhead_s", 1e-4, 0.2, ("colocated", "probe"), "itl_p50"),
            ("step_per_seq_s", 1e-5, 0.05, ("disagg", "load"), "itl_p50"),
            ("ttft_fixed_s", 1e-3, 0.6, ("colocated", "probe"), "ttft_p50"),
            ("prefill_token_s", 1e-5, 2e-2, ("colocated", "probe"), "ttft_p90"),
            ("transfer_fixed_s", 1e-4, 2.0, ("disagg", "probe"), "ttft_p50"))
#: The same, where the serving run measured its mixed steps (``CpuCosts.mixed_batches``): they
#: price the colocated replica's prompt chunks, and its whole prompts' line (else the mixed line
#: at batch 0) the prefill replica's steps (a fixed cost a step and a cost a token), so nothing
#: prices prefill from a fit.
CPU_FITS_MIXED = tuple(fit for fit in CPU_FITS if fit[0] != "prefill_token_s")
#: The served colocated replica's prompt-chunk step target: it is a decode replica prefilling
#: locally, whose ChunkSizer aims at local_prefill_itl_share of the app's target_itl_s.
SERVED_CHUNK_STEP_S = TransferConfig().local_prefill_itl_share * ClusterConfig().target_itl_s
#: the engine file a serving run without its own step table (``replica_steps``) is priced from
DEFAULT_CPU_ENGINE_FILE = "engine-cpu-2026-12-06-vnni.json"
CPU_SERVE_MODES = ("colocated", "disagg")  # "local" (no Ray, no router) is not a cluster layout


def replica_step_table(serve: dict[str, Any]) -> dict[str, Any] | None:
    """The serving run's own step table (``bench/serve_compare.py``'s ``replica_steps``: the
    engine at the served replica's thread count, timed before and after the deployments in the
    same run), as an engine file's rows: each batch's mean of the two."""
    steps = serve.get("replica_steps")
    if not steps:
        return None
    runs = [steps[when] for when in ("before", "after") if steps.get(when)]
    times: dict[int, list[float]] = {}
    for row in (row for run in runs for row in run.get("rows", [])):
        times.setdefault(int(row["batch"]), []).append(float(row["decode_step_ms"]))
    # the mixed steps: each batch's line through its two chunk caps' (tokens, ms), before and after
    mixed: dict[int, dict[float, list[float]]] = {}
    for row in (row for run in runs for row in run.get("mixed", [])):
        mixed.setdefault(int(row["batch"]), {}).setdefault(float(row["prompt_tokens"]), []).append(
            float(row["step_ms"]))
    lines = []
    for b, points in sorted(mixed.items()):
        if len(points) < 2:
            continue
        (n0, t0), (n1, t1) = [(n, sum(t) / len(t)) for n, t in sorted(points.items())][:2]
        per_token = max(0.0, (t1 - t0) / (n1 - n0))
        lines.append({"batch": b, "base_ms": t0 - per_token * n0, "per_token_ms": per_token})
    # a prefill replica's step (a prompt whole): a least-squares line through the timed prompts
    whole = [(float(r["prompt_tokens"]), float(r["step_ms"])) for run in runs for r in run.get("prefill", [])]
    prefill = None
    if len({n for n, _ in whole}) >= 2:
        slope, intercept = np.polyfit([n for n, _ in whole], [t for _, t in whole], 1)
        prefill = {"base_ms": float(max(0.0, intercept)), "per_token_ms": float(max(0.0, slope)),
                   "points": len(whole)}
    return {"rows": [{"batch": b, "ours": {"decode_step_ms": sum(t) / len(t)}} for b, t in sorted(times.items())],
            "mixed": lines, "prefill": prefill, "threads": int(runs[0].get("threads", 0)) if runs else 0,
            "_file": "replica_steps (the serving run's own)"}


def cpu_costs(engine: dict[str, Any], cores: int = 0) -> CpuCosts:
    """Costs from an engine step table; ``cores``: the serving machine's, which two replicas of
    the table's thread count (where it says) may fit without time slicing."""
    rows = sorted(engine["rows"], key=lambda r: r["batch"])
    mixed = engine.get("mixed") or []
    # a prefill replica's step: the timed whole prompts' line, else the mixed line at batch 0
    alone = [engine["prefill"]] if engine.get("prefill") else [m for m in mixed if m["batch"] == 0]
    prefill = (dict(prefill_overhead_s=alone[0]["base_ms"] / 1e3, prefill_token_s=alone[0]["per_token_ms"] / 1e3)
               if alone else dict(prefill_overhead_s=0.0))
    return CpuCosts(**prefill,  # type: ignore[arg-type]
                    step_batches=tuple(float(r["batch"]) for r in rows),
                    step_seconds=tuple(r["ours"]["decode_step_ms"] / 1e3 for r in rows),
                    mixed_batches=tuple(float(m["batch"]) for m in mixed),
                    mixed_base_s=tuple(m["base_ms"] / 1e3 for m in mixed),
                    mixed_token_s=tuple(m["per_token_ms"] / 1e3 for m in mixed),
                    host_overlaps_gpu=False, kv_tokens=1e9, max_batched_tokens=2048, max_num_seqs=64,
                    ttft_fixed_s=0.0, first_token_steps=0.0,
                    own_cores=0 < 2 * int(engine.get("threads") or 0) <= cores,
                    sources={"engine": engine["_file"]})


def measured_requests(row: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The run's own requests in the order its clients sent them (prompt and output tokens), when
    it recorded them; arrival times are unused (closed loop)."""
    reqs = row.get("requests")
    if not reqs or any(r.get("prompt_tokens") is None for r in reqs):
        return None
    n = len(reqs)
    out = {"arrival": np.zeros(n), "prompt": np.array([r["prompt_tokens"] for r in reqs], dtype=float),
           "output": np.array([r.get("output_tokens") or row["config"]["output_len"] for r in reqs], dtype=float),
           "phase": np.zeros(n, dtype=int)}
    if all(isinstance(r.get("itl_s"), list) for r in reqs):  # each stream's text chunks: its gaps + 1
        out["chunks"] = np.array([len(r["itl_s"]) + 1 for r in reqs], dtype=float)
    return out


#: The served decode replica's learned prompt-chunk cap, as ``bench/serve_compare.py`` samples it.
SERVED_CAP_SERIES = "cluster:prefill_chunk_cap{decode}"
#: The sizer's first cap (it holds until a step beside decoding requests teaches it).
SIZER_FIRST_CAP = ChunkSizer(1.0, 1 << 30).cap


#: The parts of a TTFT that the served run's own account of each request (``server_timings``:
#: ``bench/serve.py --server-timings``) and the simulator can both name: the wait until the first
#: step computing the prompt, that prompt's compute (its first step until the step computing its
#: end), and the rest of the client's TTFT (the KV hand-over, the first decode step, and the host
#: path: HTTP, the proxy, templating, routing, the stream back). Medians over the requests.
TTFT_PARTS = ("queue", "prefill_compute", "rest")


def measured_ttft_parts(row: dict[str, Any]) -> dict[str, float] | None:
    """``TTFT_PARTS`` from the row's requests' ``server_timings`` (None where the run has none).
    A prompt a decode replica prefilled: the queue as its engine measured it (from the front
    end's hand-off), the compute as its own TTFT less that queue. A prompt a prefill replica
    computed: the compute as it reported it, and the queue as the decode replica saw it, its TTFT
    less the compute, the KV transfer and the first decode step (from taking the request: the
    wait for KV blocks, at the prefill handle and in the prefill replica's queue, which alone
    sees only the last). The rest is the client's TTFT less both."""
    parts = []
    for r in row.get("requests") or []:
        t = r.get("server_timings") or {}
        if r.get("error") is None and r.get("ttft_s") is not None and "queue" in t:
            compute = t.get("prefill_compute")
            worker = t.get("worker_ttft", t["queue"])
            if compute is None:
                queue, compute = t["queue"], max(0.0, worker - t["queue"])
            else:
                queue = max(0.0, worker - compute - t.get("transfer", 0.0) - t.get("first_decode", 0.0))
            parts.append((queue, compute, r["ttft_s"] - queue - compute))
    if not parts:
        return None
    return {name: float(np.median([p[i] for p in parts])) for i, name in enumerate(TTFT_PARTS)}


def simulated_ttft_parts(sim: Simulation) -> dict[str, float]:
    """``TTFT_PARTS`` of a simulation's requests: arrival until its prefill began, until it ended,
    until the first token."""
    arrival = sim.r["arrival"]
    queue, compute = sim.prefill_start - arrival, sim.prefill_done - sim.prefill_start
    rest = sim.first_token - sim.prefill_done
    return {name: float(np.nanmedian(x)) for name, x in zip(TTFT_PARTS, (queue, compute, rest))}


def learned_cap_mean(samples: Sequence[Sequence[float]]) -> float | None:
    """The mean of a cap's samples from the first one off the sizer's first cap (once it has
    learned from a step beside decoding requests: down where such steps outlast the target, up
    where they are short of it); None if it never learned."""
    caps = [float(c) for _, c in samples]
    start = next((i for i, c in enumerate(caps) if c != SIZER_FIRST_CAP), None)
    return None if start is None else float(np.mean(caps[start:]))


def served_caps(row: dict[str, Any]) -> list[list[float]] | None:
    """The row's sampled served chunk cap (``server_metrics``), if the run recorded it."""
    return (row.get("server_metrics") or {}).get("series", {}).get(SERVED_CAP_SERIES)


def starting_cap(row: dict[str, Any]) -> int | None:
    """The served replica's chunk cap as the run began (its first sample): a deployment serves
    its runs in turn, so a later run starts from the cap the earlier ones taught (the served
    H100 run's 8 req/s began at 4,096). None where the run sampled none."""
    caps = served_caps(row)
    return int(caps[0][1]) if caps else None


def simulate_cpu(costs: Costs, row: dict[str, Any], mode: str, seeds: int, chunks: str = "sizer"
                 ) -> dict[str, Any]:
    """The row's closed-loop workload (``concurrency`` clients): the run's own requests where it
    recorded them (one deterministic run), else medians over ``seeds`` draws of its lengths. The
    prefill replica runs budget-packed steps (``Simulation.prefill_steps``), as the engine does.
    ``chunks``: how the colocated replica cuts prompt chunks: ``sizer`` (the engine's own
    ChunkSizer), ``ideal`` (the tokens that fill the step target) or ``served`` (the served
    replica's sampled cap, replayed). Adds ``chunk_cap_mean``: the simulated cap's learned mean."""
    cfg = row["config"]
    own = measured_requests(row)
    workloads = [own] if own is not None else [serve_run_requests(cfg, 1.0, seed) for seed in range(seeds)]
    replay = served_caps(row) if chunks == "served" and mode == "colocated" else None
    if chunks == "served" and mode == "colocated" and not replay:
        raise ValueError("--chunks served needs a serving run that sampled the served chunk cap")
    outs, caps, parts = [], [], []
    for requests in workloads:
        sim = Simulation(costs, requests, prefill=1, decode=1, colocated=mode == "colocated", dt=0.002,
                         ttft_target=cfg["ttft_target_s"], itl_target=cfg["itl_target_s"],
                         shared_gpu=mode == "disagg" and not getattr(costs, "own_cores", False), gpus=1,
                         concurrency=int(cfg["concurrency"]),
                         chunk_step_s=SERVED_CHUNK_STEP_S if mode == "colocated" else None, prefill_steps=True,
                         chunk_sizer=chunks == "sizer", chunk_caps=replay, chunk_sizer_cap=starting_cap(row))
        outs.append(sim.run())
        caps.append(learned_cap_mean(sim.cap_samples))
        parts.append(simulated_ttft_parts(sim))
    out: dict[str, Any] = {k: float(np.median([o[k] for o in outs])) for k in METRICS}
    learned = [c for c in caps if c is not None]
    out["chunk_cap_mean"] = float(np.median(learned)) if learned else float("nan")
    out["ttft_parts"] = {k: float(np.median([p[k] for p in parts])) for k in TTFT_PARTS}
    return out


def compare_row(name: str, sim: dict[str, Any], row: dict[str, Any],
                fits: tuple[tuple[str, float, float, Any, str], ...], key: Any, predicted: list[float]
                ) -> dict[str, Any]:
    """A served row against its simulation: the residuals, the metrics fitted on it, and the
    learned chunk cap's mean beside the served one's where both learned; the row's unfitted
    residuals (goodput aside) are appended to ``predicted``, and the row is printed."""
    meas = measured(row)
    residual = {k: (sim[k] - meas[k]) / meas[k] if meas[k] else None for k in METRICS}
    fitted_on = sorted({m for _, _, _, fit_key, m in fits if fit_key == key})
    for k in METRICS:
        if k not in fitted_on and residual[k] is not None and k != "goodput_fraction":
            predicted.append(abs(residual[k]))
    out: dict[str, Any] = {"fitted_on_this_row": fitted_on or None, "simulated": sim, "measured": meas,
                           "residual": residual}
    served_parts = measured_ttft_parts(row)
    if served_parts is not None and "ttft_parts" in sim:  # where the TTFT went, both sides (not counted)
        out["ttft_parts"] = {"served": served_parts, "simulated": sim["ttft_parts"],
                             "residual": {k: (sim["ttft_parts"][k] - v) / v if v else None
                                          for k, v in served_parts.items()}}
    served = learned_cap_mean(served_caps(row) or [])
    if served is not None and np.isfinite(sim["chunk_cap_mean"]):  # the sizer's state, beside the client's view
        out["chunk_cap_mean"] = {"served": served, "simulated": sim["chunk_cap_mean"],
                                 "residual": (sim["chunk_cap_mean"] - served) / served}
    print(name, {k: None if v is None else round(v, 3) for k, v in residual.items()})
    return out


def validate_cpu(args: argparse.Namespace) -> dict[str, Any]:
    path = args.cpu_serve_file or sorted(glob.glob(os.path.join(RESULTS, "serve-cpu-*.json")))[-1]
    path = path if os.path.exists(path) else os.path.join(RESULTS, path)
    with open(path) as f:
        serve = json.load(f)
    engine = replica_step_table(serve) if not args.cpu_engine_file else None
    if engine is None:
        engine_path = os.path.join(RESULTS, args.cpu_engine_file or DEFAULT_CPU_ENGINE_FILE)
        with open(engine_path) as f:
            engine = dict(json.load(f), _file=os.path.basename(engine_path))
    rows = {(mode, phase): serve["runs"][mode][phase] for mode in CPU_SERVE_MODES for phase in ("probe", "load")}
    # the stream's textless tokens, from the colocated probe (one request at a time, so every gap
    # is one step or two): ITL mean / TPOT mean = 1 / (1 - share); neither mean is a compared metric
    probe = rows[("colocated", "probe")]
    share = min(0.45, max(0.0, 1.0 - probe["tpot_s"]["mean"] / probe["itl_s"]["mean"]))
    # how one-step gaps scatter under load, from the same file's no-Ray server under the same load
    # (not a compared row): the engine's and the HTTP stream's jitter, without Ray's
    local = serve["runs"].get("local", {}).get("load", {})
    spread_bins, spread_weights = gap_spread(np.concatenate(
        [r["itl_s"] for r in local.get("requests", []) if isinstance(r.get("itl_s"), list)] or [np.zeros(0)]))
    base = dataclasses.replace(cpu_costs(engine, int(serve["environment"].get("cpu_count") or 0)),
                               textless_token_share=share, gap_spread_bins=spread_bins,
                               gap_spread_weights=spread_weights)
    fits = CPU_FITS_MIXED if base.mixed_batches else CPU_FITS
    costs = fit_constants(base, fits, args,
                          lambda key: measured(rows[key]), lambda c, key: simulate_cpu(c, rows[key], key[0], args.seeds, args.chunks))
    out_rows: dict[str, Any] = {}
    predicted: list[float] = []
    for (mode, phase), row in rows.items():
        name = f"{os.path.basename(path)}:{mode}-{phase}-c{row['config']['concurrency']}"
        out_rows[name] = compare_row(name, simulate_cpu(costs, row, mode, args.seeds, args.chunks), row,
                                     fits, (mode, phase), predicted)
    fitted = {attr: getattr(costs, attr) for attr, *_ in fits}
    fitted["textless_token_share"] = costs.textless_token_share
    fitted["gap_spread_source"] = "runs.local.load" if spread_bins else None
    return {"benchmark": "simulator-validation-cpu", "environment": environment(), "serve_file": os.path.basename(path),
            "engine_file": engine["_file"], "fitted": fitted, "costs": dataclasses.asdict(costs),
            "predicted_abs_residual": abs_residual_summary(predicted),
            "rows": out_rows,
            "note": "closed-loop clients as the serving benchmark runs them (concurrency 1 for the probe, 8 for the "
                    "load; 10 and 32 requests, 256 +- 50% prompt tokens, 32 out); fitted: the serving host's time "
                    "per step (colocated ITL p50 at concurrency 1) and per running sequence (disaggregated ITL p50 at 8: its "
                    "decode replica only decodes), a first token's "
                    "fixed host path and the prefill time per token (colocated TTFT p50 and p90 at 1) and the "
                    "disaggregated hand-over (disaggregated TTFT p50 at 1); the share of streamed tokens that bring no "
                    "text (their chunk's gap spans two steps; ITL is per text chunk) from the colocated probe's ITL mean "
                    "over its TPOT mean (neither a compared metric); every other number (the ITL p90s, TPOT, "
                    "the colocated ITL at 8, the disaggregated ITL at 1, both runs' TTFT at 8) is a prediction. The decode compute is the engine's measured step time by batch. Disaggregated: "
                    "prefill and decode replicas time-slice the same two cores. Goodput fractions are reported but "
                    "not counted in the residual summary (a fraction of 10 or 32 requests)."}


#: A GPU serving run priced from its own step table (``bench/serve_gpu.py``'s ``replica_steps``):
#: (parameter, low, high, the row (mode, rate) whose metric it matches, metric). The serving host's
#: time per step and per running sequence from the disaggregated ITLs (its decode replica only
#: decodes), a first token's fixed host path from the colocated TTFT at the lower rate and the
#: hand-over (KV transfer and first decode) from the disaggregated one.
OWN_GPU_FITS = (("step_overhead_s", 1e-5, 2e-2, ("disagg", 4.0), "itl_p50"),
                ("step_per_seq_s", 1e-7, 5e-3, ("disagg", 8.0), "itl_p50"),
                ("ttft_fixed_s", 1e-4, 0.2, ("colocated", 4.0), "ttft_p50"),
                ("transfer_fixed_s", 1e-4, 0.2, ("disagg", 4.0), "ttft_p50"))


def open_loop_requests(row: dict[str, Any]) -> dict[str, np.ndarray]:
    """A rate run's own requests at the times its client sent them (``start_s``)."""
    requests = measured_requests(row)
    if requests is None:
        raise ValueError("the serving run kept no requests to replay")
    requests["arrival"] = np.array([float(r["start_s"]) for r in row["requests"]])
    return requests


def own_gpu_costs(serve: dict[str, Any]) -> CpuCosts:
    """A GPU serving run's costs from its own step table: decode steps by batch, prompt chunks
    beside decoding requests from the mixed lines, the prefill replica from the whole prompts'
    line; the host overlaps the device (pipelined steps); the run's KV pool, budget and sequences."""
    table = replica_step_table(serve)
    if table is None:
        raise ValueError("the serving run has no replica_steps (bench/serve_gpu.py records them)")
    settings = serve["modes"]["disagg"]["settings"]
    costs = dataclasses.replace(cpu_costs(table), layers=int(serve["config"]["num_hidden_layers"]),
                                host_overlaps_gpu=True, max_batched_tokens=int(settings["max_num_batched_tokens"]),
                                max_num_seqs=int(settings["max_num_seqs"]))
    return dataclasses.replace(costs, kv_tokens=float(serve["workload"]["kv_bytes"]) / costs.kv_bytes_per_token)


def simulate_own_gpu(costs: Costs, serve: dict[str, Any], mode: str, rate: float, chunks: str) -> dict[str, Any]:
    """One rate run replayed: its requests at their send times, one prefill and one decode replica
    sharing the GPU (disaggregated) or one replica (colocated, chunks as ``simulate_cpu``'s)."""
    row = serve["modes"][mode]["runs"][str(rate)]
    wl = serve["workload"]
    replay = served_caps(row) if chunks == "served" and mode == "colocated" else None
    sim = Simulation(costs, open_loop_requests(row), prefill=1, decode=1, colocated=mode == "colocated",
                     dt=0.0005, ttft_target=wl["ttft_target_s"], itl_target=wl["itl_target_s"],
                     shared_gpu=mode == "disagg", gpus=1, prefill_steps=True,
                     chunk_step_s=SERVED_CHUNK_STEP_S if mode == "colocated" else None,
                     chunk_sizer=chunks == "sizer", chunk_caps=replay, chunk_sizer_cap=starting_cap(row))
    out = sim.run()
    result: dict[str, Any] = {k: float(out[k]) for k in METRICS}
    result["chunk_cap_mean"] = learned_cap_mean(sim.cap_samples) or float("nan")
    result["ttft_parts"] = simulated_ttft_parts(sim)
    return result


def validate_own_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """A GPU serving run against the simulator priced from the run's own step table (no engine
    file of another run, no other card's numbers); ``OWN_GPU_FITS`` fitted on it."""
    path = args.gpu_serve_file if os.path.exists(args.gpu_serve_file) else os.path.join(RESULTS, args.gpu_serve_file)
    with open(path) as f:
        serve = json.load(f)
    rows = {(mode, float(rate)): r for mode in ("disagg", "colocated") for rate, r in serve["modes"][mode]["runs"].items()}
    costs = fit_constants(own_gpu_costs(serve), OWN_GPU_FITS, args, lambda key: measured(rows[key]),
                          lambda c, key: simulate_own_gpu(c, serve, key[0], key[1], args.chunks))
    out_rows: dict[str, Any] = {}
    predicted: list[float] = []
    for (mode, rate), row in sorted(rows.items()):
        name = f"{os.path.basename(path)}:{mode}-rate{rate:g}"
        out_rows[name] = compare_row(name, simulate_own_gpu(costs, serve, mode, rate, args.chunks), row,
                                     OWN_GPU_FITS, (mode, rate), predicted)
    return {"benchmark": "simulator-validation-own-steps", "environment": environment(),
            "serve_file": os.path.basename(path), "device": serve["replica_steps"].get("before", {}).get("device"),
            "chunks": args.chunks, "fitted": {attr: getattr(costs, attr) for attr, *_ in OWN_GPU_FITS},
            "costs": dataclasses.asdict(costs), "predicted_abs_residual": abs_residual_summary(predicted),
            "rows": out_rows,
            "note": "each rate run replayed with its own requests at their send times; steps priced from the "
                    "engine's step table timed on the same GPU in the same run (decode by batch, prompt chunks "
                    "beside decoding requests, prompts whole); fitted: the serving host's time per step and per "
                    "running sequence (disaggregated ITL p50 at 4 and 8 req/s), a first token's fixed host path "
                    "(colocated TTFT p50 at 4) and the hand-over (disaggregated TTFT p50 at 4); every other "
                    "number is a prediction. Goodput fractions are reported but not counted."}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit-file", default=None)
    parser.add_argument("--seeds", type=int, default=5,
                        help="GPU runs: 0 replays each run's own requests (its recorded client config); N: medians "
                             "over N other draws of its workload")
    parser.add_argument("--fit-iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4,
                        help="rounds over the fitted constants (coupled ones settle over several: 2 left the "
                             "own-steps GPU fit's ITL p50 at 4 req/s 18%% off its target)")
    parser.add_argument("--cpu", action="store_true", help="validate against the CPU serving run instead")
    parser.add_argument("--cpu-serve-file", default=None, help="default: the latest serve-cpu-*.json")
    parser.add_argument("--cpu-engine-file", default=None,
                        help="the engine's decode step times on the CPU (same code as the serving run); default: "
                             "the serving run's own replica_steps where it has them, else "
                             f"{DEFAULT_CPU_ENGINE_FILE}")
    parser.add_argument("--prefill-steps", action="store_true",
                        help="GPU runs: the prefill replica in budget-packed steps (Simulation.prefill_steps; "
                             "the CPU validation always uses them)")
    parser.add_argument("--chunks", choices=("sizer", "ideal", "served"), default="sizer",
                        help="CPU: how the colocated replica cuts prompt chunks: the engine's own ChunkSizer "
                             "(Simulation.chunk_sizer), the tokens that fill the step target exactly, or the served "
                             "replica's sampled cap replayed (Simulation.chunk_caps; an input, not a prediction)")
    parser.add_argument("--gpu-serve-file", default=None,
                        help="a GPU serving run with its own step table (bench/serve_gpu.py's replica_steps): "
                             "validate against it, priced from that table")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.gpu_serve_file:
        result = {"validation_own_steps": validate_own_gpu(args)}
    else:
        result = {"validation_cpu": validate_cpu(args)} if args.cpu else {"validation": validate(args)}
    if args.out:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
