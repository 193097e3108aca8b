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
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, write_result  # noqa: E402
from bench.simulate import RESULTS, Costs, Simulation, serve_run_requests  # noqa: E402

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


def simulate(costs: Costs, run: dict[str, Any], mode: str, rate: float, seeds: int) -> dict[str, float]:
    """Medians over ``seeds`` draws of the run's workload (its own draw cannot be replayed)."""
    cfg = run["rows"][(mode, rate)]["config"]
    wl = run["serve"]["workload"]
    outs = []
    for seed in range(seeds):
        sim = Simulation(costs, serve_run_requests(cfg, rate, seed), prefill=1, decode=1, colocated=mode == "colocated",
                         dt=0.002, ttft_target=wl["ttft_target_s"], itl_target=wl["itl_target_s"],
                         shared_gpu=mode == "disagg", gpus=1)
        outs.append(sim.run())
    return {k: float(np.median([o[k] for o in outs])) for k in METRICS}


def fit(costs: Costs, run: dict[str, Any], args: argparse.Namespace) -> Costs:
    """Each constant by bisection on its row's metric, the others held; rounds until they settle."""
    for _ in range(args.rounds):
        for attr, low, high, rate, metric in FITS:
            want = measured(run["rows"][("disagg", rate)])[metric]
            for _ in range(args.fit_iters):
                mid = math.sqrt(low * high)
                got = simulate(dataclasses.replace(costs, **{attr: mid}), run, "disagg", rate, args.seeds)[metric]
                low, high = (low, mid) if got > want else (mid, high)
            costs = dataclasses.replace(costs, **{attr: math.sqrt(low * high)})
    return costs


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
            sim = simulate(run_costs, run, mode, rate, args.seeds)
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
            "predicted_p50_abs_residual": {"max": max(predicted), "median": float(np.median(predicted)),
                                           "within_15pct": sum(r <= 0.15 for r in predicted), "of": len(predicted)},
            "rows": out_rows,
            "note": "fitted on the disaggregated rows of fit_file (ITL p50 and TTFT p50 at 4 and 8 req/s); every "
                    "other number is a prediction. Disaggregated rows: prefill and decode replicas time-slice one "
                    "GPU (prefill gets what decode's GPU work leaves, at least half; decode's GPU part waits for "
                    "prefill's slices). Seeds: medians over draws of each row's workload, not its own draw."}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit-file", default=None)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--fit-iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = {"validation": validate(args)}
    if args.out:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
