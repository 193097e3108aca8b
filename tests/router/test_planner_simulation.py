"""The cluster simulator (``bench/simulate.py``) that drives the planner at scales these machines
cannot hold: requests are conserved, latencies respect the cost model's floors, disaggregation
keeps decode steps free of prefill chunks, and the planner moves replicas toward the role that
misses its target."""
from __future__ import annotations

import numpy as np

from bench.simulate import Costs, Phase, Simulation, make_requests
from cluster.router.planner import PlannerSettings


def _costs() -> Costs:
    return Costs(prefill_flops_s=2e14, step_overhead_s=0.002, startup_s=20.0)


def test_every_request_completes_and_latencies_respect_the_cost_model():
    costs = _costs()
    reqs = make_requests([Phase(20.0, 4.0, "chat")], seed=1)
    out = Simulation(costs, reqs, prefill=2, decode=2, dt=0.01).run()
    assert out["completed"] == out["requests"] == len(reqs["arrival"]) > 40
    floor_ttft = min(costs.prefill_seconds(float(p), float(p)) for p in reqs["prompt"])
    assert out["ttft_p50"] >= floor_ttft
    floor_step = float(costs.decode_step(np.array([1.0]), np.array([1.0]))[0])
    assert out["itl_p50"] >= floor_step * 0.9  # histogram bins: 3% wide


def test_colocated_decode_steps_carry_prefill_chunks():
    """The interference disaggregation removes: with long prompts arriving, colocated steps are
    slower than disaggregated ones at the same load."""
    costs = _costs()
    reqs = make_requests([Phase(20.0, 3.0, "rag")], seed=2)
    disagg = Simulation(costs, reqs, prefill=2, decode=2, dt=0.01).run()
    colocated = Simulation(costs, reqs, prefill=0, decode=4, colocated=True, dt=0.01).run()
    assert colocated["completed"] == disagg["completed"] == len(reqs["arrival"])
    assert colocated["tokens_over_itl_target"] > 0.0 == disagg["tokens_over_itl_target"]


def test_the_planner_grows_the_role_that_misses_its_target():
    """Long prompts overload one prefill replica: the planner (the project's ``plan``) takes
    replicas from decode, within the GPU budget, and TTFT comes back under its target."""
    costs = _costs()
    reqs = make_requests([Phase(240.0, 6.0, "rag")], seed=3)
    settings = PlannerSettings(target_ttft_s=1.0, target_itl_s=0.05, max_prefill=7, max_decode=7,
                               max_total_replicas=8, initial_prefill=1, initial_decode=7)
    sim = Simulation(costs, reqs, prefill=1, decode=7, planner=settings, dt=0.02, gpus=8)
    out = sim.run()
    timeline = out["timeline"]
    assert max(x["prefill"] for x in timeline) > 1
    assert all(x["gpus_held"] <= 8 for x in timeline)
    assert timeline[-1]["ttft_p90"] <= 1.0 or out["phases"][0]["goodput_fraction"] > 0.5
