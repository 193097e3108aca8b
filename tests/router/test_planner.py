"""The planner: the pure core on scripted load (prefill-bound, decode-bound, trading at the budget,
idle, no flapping), the Ray Serve adapters called with AutoscalingContexts built as Ray builds
them (also through Ray's own wrapper for application-level policies), the wiring build_app uses,
and the metrics the decode and prefill replicas report for it."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cluster.common.messages import GenerateRequest, ReplicaStats, StepOutput
from cluster.common.sampling_params import SamplingParams
from cluster.config import parse_cluster_args
from cluster.router import planner
from cluster.router.planner import Observation, PlannerSettings, PlannerState, RoleLoad, plan

BUDGET = 8


def make_settings(**overrides: Any) -> PlannerSettings:
    base = dict(target_ttft_s=1.0, target_itl_s=0.1, min_prefill=1, max_prefill=7, min_decode=1,
                max_decode=7, max_total_replicas=BUDGET, upscale_cooldown_s=30.0, downscale_cooldown_s=120.0,
                initial_prefill=2, initial_decode=2, hold_budget=False)  # rule 9's tests turn it on
    return PlannerSettings(**{**base, **overrides})


def observe(p: int = 2, d: int = 2, *, ttft: float = 0.45, itl: float = 0.045, queue: float = 0.05,
            p_waiting: float = 0.0, d_waiting: float = 0.0, kv: float = 0.45) -> Observation:
    """A steady cluster unless told otherwise: pressures about 0.5, too busy to lose a replica."""
    return Observation(prefill=RoleLoad(p, waiting=p_waiting, kv_usage=0.2),
                       decode=RoleLoad(d, waiting=d_waiting, kv_usage=kv),
                       ttft_s=ttft, itl_s=itl, prefill_queue_s=queue)


def counts(decision: planner.Decision) -> tuple[int, int]:
    return decision.replicas["prefill"], decision.replicas["decode"]


# --- the core ---------------------------------------------------------------------------------------

def test_steady_load_holds():
    decision = plan(observe(), make_settings(), PlannerState(), now=1000.0)
    assert counts(decision) == (2, 2) and decision.reason == "" and decision.state == PlannerState()


def test_prefill_bound_load_grows_prefill():
    decision = plan(observe(ttft=2.0, queue=1.5, p_waiting=12), make_settings(), PlannerState(), now=1000.0)
    assert counts(decision) == (4, 2)  # pressure 3: at most doubling
    assert decision.state.prefill_up == 1000.0 and decision.state.decode_up is None
    assert "prefill 2->4" in decision.reason


def test_ttft_alone_is_prefill_pressure_when_decode_is_fine():
    assert counts(plan(observe(ttft=1.3), make_settings(), PlannerState(), now=1000.0)) == (3, 2)


@pytest.mark.parametrize("signal", [{"itl": 0.15}, {"kv": 0.97}, {"d_waiting": 20.0}])
def test_decode_bound_load_grows_decode(signal):
    p, d = counts(plan(observe(**signal), make_settings(), PlannerState(), now=1000.0))
    assert p == 2 and d > 2


def test_slow_first_tokens_from_a_congested_decode_grow_decode_not_prefill():
    decision = plan(observe(ttft=2.5, kv=0.97), make_settings(), PlannerState(), now=1000.0)
    assert counts(decision) == (2, 4)


def test_without_a_prefill_role_decode_owns_ttft():
    obs = Observation(decode=RoleLoad(2, kv_usage=0.2), ttft_s=1.5)
    decision = plan(obs, make_settings(has_prefill=False), PlannerState(), now=1000.0)
    assert decision.replicas == {"decode": 3}


def test_at_the_budget_the_role_with_slack_gives_replicas():
    decision = plan(observe(4, 4, ttft=2.0, queue=1.2, itl=0.01, kv=0.1), make_settings(), PlannerState(), now=1000.0)
    p, d = counts(decision)
    assert p + d == BUDGET and p > 4 and d < 4
    assert d >= 2  # at most half of the donor's replicas at a time
    assert "decode gives" in decision.reason
    assert decision.state.prefill_up == 1000.0 and decision.state.decode_down == 1000.0


def test_at_the_budget_a_donor_keeps_what_it_needs():
    # Decode at 0.6 of its ITL target cannot lose a replica of 4 (0.6 * 4/3 = 0.8 is the headroom
    # limit; two would be 1.2): it gives one, and prefill grows by one.
    decision = plan(observe(4, 4, ttft=2.0, itl=0.06, kv=0.1), make_settings(), PlannerState(), now=1000.0)
    assert counts(decision) == (5, 3)
    busy = plan(observe(4, 4, ttft=2.0, itl=0.09, kv=0.1), make_settings(), PlannerState(), now=1000.0)
    assert counts(busy) == (4, 4)  # no donor: the growth is cut to the budget


def test_both_over_at_the_budget_holds():
    decision = plan(observe(4, 4, ttft=2.0, queue=1.0, itl=0.2), make_settings(), PlannerState(), now=1000.0)
    assert counts(decision) == (4, 4)


def test_without_a_budget_roles_grow_to_their_maximum():
    decision = plan(observe(4, 4, ttft=3.0, queue=2.0, itl=0.3), make_settings(max_total_replicas=None),
                    PlannerState(), now=1000.0)
    assert counts(decision) == (7, 7)


def test_idle_scales_down_to_minimums_one_role_per_cooldown():
    s = make_settings()
    p, d, state = 4, 4, PlannerState()
    changes: list[tuple[float, int, int]] = []
    for tick in range(200):
        now = 1000.0 + 10.0 * tick
        decision = plan(observe(p, d, ttft=0.0, itl=0.0, queue=0.0, kv=0.0), s, state, now)
        if counts(decision) != (p, d):
            changes.append((now, *counts(decision)))
        (p, d), state = counts(decision), decision.state
    assert (p, d) == (1, 1)
    assert len(changes) == 6  # one replica at a time
    times = [t for t, _, _ in changes]
    assert all(b - a >= s.downscale_cooldown_s for a, b in zip(times, times[1:]))


def test_no_flapping_within_the_cooldown():
    s = make_settings()
    swap = plan(observe(4, 4, ttft=2.0, itl=0.02, kv=0.1), s, PlannerState(), now=1000.0)
    p, d = counts(swap)
    assert (p, d) == (6, 2)
    # Right after, decode misses its target: prefill grew within the cooldown, so it gives nothing
    # back; at the budget decode cannot grow either.
    after = plan(observe(p, d, itl=0.15), s, swap.state, now=1010.0)
    assert counts(after) == (6, 2)
    # Prefill still over, but within its upscale cooldown: it waits.
    again = plan(observe(p, d, ttft=2.0, itl=0.02, kv=0.1), s, swap.state, now=1010.0)
    assert counts(again) == (6, 2)
    # Load gone: nothing shrinks before the downscale cooldown.
    quiet = plan(observe(p, d, ttft=0.0, itl=0.0, queue=0.0, kv=0.0), s, swap.state, now=1100.0)
    assert counts(quiet) == (6, 2)
    later = plan(observe(p, d, ttft=0.0, itl=0.0, queue=0.0, kv=0.0), s, swap.state, now=1121.0)
    assert counts(later) == (5, 2)


def test_starting_replicas_and_missing_reports_hold():
    s = make_settings()
    starting = Observation(prefill=RoleLoad(4, ready_replicas=3), decode=RoleLoad(2), ttft_s=3.0)
    assert counts(plan(starting, s, PlannerState(), now=1000.0)) == (4, 2)
    silent = Observation(prefill=RoleLoad(4, reported=False), decode=RoleLoad(4, reported=False))
    assert counts(plan(silent, s, PlannerState(), now=1e6)) == (4, 4)  # no data is not idle


def test_counts_outside_the_bounds_are_brought_back():
    decision = plan(observe(9, 2), make_settings(max_total_replicas=None), PlannerState(), now=1000.0)
    assert counts(decision) == (7, 2)


# --- predictive sizing (demand x profiled cost per replica) -----------------------------------------

def profiled(**overrides: Any) -> PlannerSettings:
    """A replica prefills 10,000 prompt tokens/s and decodes 1,000 tokens/s; at 80% utilisation."""
    return make_settings(prefill_tokens_per_s=10_000.0, decode_tokens_per_s=1_000.0, **overrides)


def with_demand(obs: Observation, rps: float, prompt: float, output: float) -> Observation:
    return dataclasses.replace(obs, demand=planner.Demand(rps, prompt, output))


def test_prediction_sizes_each_role_from_arrival_rate_and_profile():
    # prefill: 4 req/s x 4,000 tokens / (10,000 x 0.8) = 2; decode: 4 x 300 / (1,000 x 0.8) = 1.5 -> 2
    need = planner.predict(with_demand(observe(), 4.0, 4000, 300), profiled())
    assert need == {"prefill": 2, "decode": 2}
    # over the budget of 8 the split follows need: 12 prefill : 6 decode -> 5 : 3 (rounding to the neediest)
    need = planner.predict(with_demand(observe(), 24.0, 4000, 160), profiled())
    assert need == {"prefill": 5, "decode": 3}
    assert planner.predict(observe(), profiled()) is None  # no demand: reactive rules only
    assert planner.predict(with_demand(observe(), 4.0, 4000, 300), make_settings()) is None  # no profile


def test_prediction_counts_decode_kv_by_littles_law():
    s = profiled(decode_kv_tokens=10_000.0, max_total_replicas=None, max_decode=16)
    # throughput: 10 req/s x 50 tokens / (1,000 x 0.8) = 0.6; KV: 10 x 50 x 0.1 s ITL = 50 requests
    # decoding, 1,050 tokens each = 52,500 tokens / (10,000 x 0.8) = 6.6 -> 7
    assert planner.predict(with_demand(observe(itl=0.1), 10.0, 1000, 50), s)["decode"] == 7
    # the same at a 0.01 s ITL: requests finish sooner, a tenth of them hold KV at once -> 1
    assert planner.predict(with_demand(observe(itl=0.01), 10.0, 1000, 50), s)["decode"] == 1


def test_a_mix_shift_moves_the_split_at_once_despite_the_cooldowns():
    """After RAG (long prompts) turns to code (long outputs) decode takes its predicted share in one
    decision, though prefill grew within the downscale cooldown; the reactive rules would wait."""
    s = profiled()
    grew_prefill = PlannerState(prefill_up=990.0)
    obs = with_demand(observe(6, 2, itl=0.09), 4.0, 4000, 700)  # prefill 2, decode 3.5 -> 4
    decision = plan(obs, s, grew_prefill, now=1000.0)
    assert counts(decision) == (2, 4) and "predicted" in decision.reason
    reactive = plan(observe(6, 2, itl=0.09), make_settings(), grew_prefill, now=1000.0)
    assert counts(reactive) == (6, 2)


def test_prediction_within_the_hysteresis_band_holds():
    s = profiled(hysteresis=0.25)
    # prefill needs 3.2 -> 4 of 4; decode needs 1.2 -> 2, one below 3: within the band (25% of 3 -> 1)...
    obs = with_demand(observe(4, 3), 6.4, 4000, 150)
    assert counts(plan(obs, s, PlannerState(), now=1000.0)) == (4, 3)
    # ...but two replicas away it moves.
    obs = with_demand(observe(4, 4), 6.4, 4000, 150)
    assert counts(plan(obs, s, PlannerState(), now=1000.0)) == (4, 2)


def test_prediction_never_shrinks_a_role_over_its_target():
    obs = with_demand(observe(4, 4, itl=0.2), 2.0, 1000, 100)  # little demand, but decode misses ITL
    decision = plan(obs, profiled(handover_starting_share=None), PlannerState(), now=1000.0)
    assert decision.replicas["decode"] >= 4 and decision.replicas["prefill"] == 1
    # paced (the default): decode takes 2 of the 8 GPUs at a time; prefill keeps serving on the rest meanwhile
    paced = plan(obs, profiled(), PlannerState(), now=1000.0)
    assert counts(paced) == (2, 6)


def test_reactive_growth_still_backs_an_underestimating_prediction():
    obs = with_demand(observe(2, 2, ttft=2.0, queue=1.5, p_waiting=12), 1.0, 1000, 100)  # predicts 1 + 1
    decision = plan(obs, profiled(), PlannerState(), now=1000.0)
    assert decision.replicas["prefill"] == 4  # pressure 3: doubled, as without a profile


def test_a_role_that_just_grew_does_not_shrink_on_a_noisy_prediction():
    """The simulator's lesson (10 s demand windows at 8 GPUs): chat's decode need sits near a
    rounding edge, and one quiet window predicted two replicas fewer, so decode shrank and grew
    back (each new replica a minute's start-up). Within downscale_cooldown_s of its growth a role
    holds; after it, or when the other role grows in the same decision (the mix shifted), it moves."""
    s = profiled()
    obs = with_demand(observe(1, 7), 2.0, 1000, 2000)  # decode 2 x 2,000 / 800 = 5: two below 7
    grew_decode = PlannerState(decode_up=950.0)
    assert counts(plan(obs, s, grew_decode, now=1000.0)) == (1, 7)
    assert counts(plan(obs, s, grew_decode, now=1100.0)) == (1, 5)  # cooled down: it shrinks
    shift = with_demand(observe(1, 7), 2.0, 12_000, 2000)  # prefill needs 3: the mix moved
    assert counts(plan(shift, s, grew_decode, now=1000.0)) == (3, 5)


def test_a_one_window_dip_in_demand_does_not_shrink_a_role():
    """The simulator's lesson (seed 1, 8 GPUs): long after decode grew, one quiet demand window
    predicted two replicas fewer; decode shrank 7 -> 5 and grew back an interval later. A role now
    shrinks only to the most it was predicted to need over downscale_window_s; a dip that lasts
    the window shrinks it; a mix shift (the other role grows) still moves it at once."""
    s = profiled()
    busy = with_demand(observe(1, 7), 2.8, 1000, 2000)  # decode 2.8 x 2,000 / 800 = 7
    quiet = with_demand(observe(1, 7), 2.0, 1000, 2000)  # 5: two below
    state = PlannerState(decode_up=0.0)  # grew long ago: settled
    for now in (1000.0, 1010.0, 1020.0):
        decision = plan(busy, s, state, now)
        assert counts(decision) == (1, 7)
        state = decision.state
    dip = plan(quiet, s, state, 1030.0)
    assert counts(dip) == (1, 7)  # 7 was predicted within the window
    state = dip.state
    for now in (1040.0, 1050.0, 1060.0, 1070.0):
        state = plan(quiet, s, state, now).state
    assert counts(plan(quiet, s, state, 1080.0)) == (1, 5)  # the last 7 left the window: it shrinks
    assert len(state.predictions) <= 7  # only the window is kept
    # the state round-trips through a policy state dict (Ray keeps it between ticks)
    assert PlannerState.from_dict(json.loads(json.dumps(dataclasses.asdict(state)))) == state
    shift = with_demand(observe(1, 7), 2.0, 12_000, 2000)  # prefill needs 3: the mix moved
    assert counts(plan(shift, s, dip.state, 1040.0)) == (3, 5)
    no_window = profiled(downscale_window_s=0.0)
    assert counts(plan(quiet, no_window, dip.state, 1040.0)) == (1, 5)


def test_a_donor_keeps_what_its_predicted_demand_needs():
    """Reactive growth past the prediction (a backlog already queued on the running prefill
    replicas, which new ones do not take over) takes no decode replica below decode's prediction."""
    # prefill needs 4 x 4,000 / 8,000 = 2, decode 4 x 600 / 800 = 3; prefill's queue says pressure 6
    obs = with_demand(observe(4, 4, ttft=5.0, queue=3.0, itl=0.01, kv=0.1), 4.0, 4000, 600)
    decision = plan(obs, profiled(), PlannerState(), now=1000.0)
    assert decision.replicas["decode"] == 3 and decision.replicas["prefill"] == 5
    without = plan(dataclasses.replace(obs, demand=None), make_settings(), PlannerState(), now=1000.0)
    assert without.replicas["decode"] == 2  # the reactive donor rule alone gives half


def test_prediction_counts_the_backlog_as_demand_to_clear():
    """The simulator's lesson at 64 GPUs: after chat turned to RAG, requests piled up for the
    minute new prefill replicas took to start; sized for arrivals at 0.8 utilisation, the spare
    fifth of capacity took minutes to clear them. Waiting requests count as arrivals to clear
    within backlog_drain_s, on both roles (they need decoding too)."""
    s = profiled(max_total_replicas=None, max_prefill=16, max_decode=16)
    # 4 req/s x 4,000 tokens: prefill 2, decode 4 x 300 / 800 = 1.5 -> 2
    assert planner.predict(with_demand(observe(2, 2), 4.0, 4000, 300), s) == {"prefill": 2, "decode": 2}
    # 240 requests waiting (60 per replica on 2 prefill and 2 decode): + 4 req/s over 60 s, so
    # prefill 8 x 4,000 / 8,000 = 4, decode 8 x 300 / 800 = 3
    queued = with_demand(observe(2, 2, p_waiting=60, d_waiting=60), 4.0, 4000, 300)
    assert planner.predict(queued, s) == {"prefill": 4, "decode": 3}
    assert planner.predict(queued, dataclasses.replace(s, backlog_drain_s=None)) == {"prefill": 2, "decode": 2}


def test_fallback_shares_split_the_budget_by_starting_replicas():
    s = make_settings(initial_prefill=2, initial_decode=6)
    assert (s.share("prefill"), s.share("decode")) == (2, 6)
    assert make_settings(max_total_replicas=None).share("decode") == 7


# --- the Ray adapters ------------------------------------------------------------------------------

APP = "cluster"


def make_context(name: str, target: int, metrics: dict[str, float] | None = None, *, current: int | None = None,
                 settings: PlannerSettings | None = None, policy_state: dict[str, Any] | None = None,
                 now: float = 1000.0) -> Any:
    """An AutoscalingContext as the controller builds one (DeploymentAutoscalingState.
    get_autoscaling_context), every running replica reporting the same ``metrics``."""
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

    s = settings or make_settings()
    low, high = s.bounds(planner.DEPLOYMENTS.get(name, "decode"))
    dep = DeploymentID(name=name, app_name=APP)
    current = target if current is None else current
    replicas = [ReplicaID(f"{name}-{i}", deployment_id=dep) for i in range(current)]
    policy = AutoscalingPolicy(policy_function="cluster.router.planner:plan_deployment",
                               policy_kwargs=dataclasses.asdict(s))
    config = AutoscalingConfig(min_replicas=low, max_replicas=high, upscale_delay_s=0.0, downscale_delay_s=0.0,
                               policy=policy)
    aggregated = {key: {r: value for r in replicas} for key, value in (metrics or {}).items()}
    return AutoscalingContext(
        deployment_id=dep, deployment_name=name, app_name=APP, current_num_replicas=current,
        target_num_replicas=target, running_replicas=replicas, total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics=aggregated, raw_metrics={}, capacity_adjusted_min_replicas=low,
        capacity_adjusted_max_replicas=high, policy_state=dict(policy_state or {}), last_scale_up_time=None,
        last_scale_down_time=None, current_time=now, config=config)


def load(waiting: float = 0.0, kv: float = 0.2) -> dict[str, float]:
    return {planner.WAITING: waiting, planner.KV_USAGE: kv}


def decode_metrics(ttft: float = 0.45, itl: float = 0.045, queue: float = 0.05, kv: float = 0.45
                   ) -> dict[str, float]:
    return {**load(kv=kv), planner.TTFT: ttft, planner.ITL: itl, planner.PREFILL_QUEUE: queue}


def by_name(result: dict[Any, Any]) -> dict[str, Any]:
    return {dep.name: value for dep, value in result.items()}


def test_application_policy_moves_replicas_to_a_prefill_bound_role():
    contexts = [make_context("PrefillServer", 4, load(waiting=10)),
                make_context("DecodeServer", 4, decode_metrics(ttft=2.0, queue=1.0, itl=0.01, kv=0.1))]
    decisions, states = planner.plan_application({c.deployment_id: c for c in contexts})
    assert by_name(decisions) == {"PrefillServer": 6, "DecodeServer": 2}
    for state in states.values():
        assert state[planner.STATE_KEY]["prefill_up"] == 1000.0


def test_application_policy_grows_decode_on_inter_token_latency():
    contexts = [make_context("PrefillServer", 2, load()), make_context("DecodeServer", 2, decode_metrics(itl=0.15))]
    decisions, _ = planner.plan_application({c.deployment_id: c for c in contexts})
    assert by_name(decisions) == {"PrefillServer": 2, "DecodeServer": 3}


def test_application_policy_holds_before_any_report_and_ignores_other_deployments():
    contexts = [make_context("PrefillServer", 2), make_context("DecodeServer", 2),
                make_context("Other", 1, load(waiting=100))]
    decisions, states = planner.plan_application({c.deployment_id: c for c in contexts})
    assert by_name(decisions) == {"PrefillServer": 2, "DecodeServer": 2}
    assert set(by_name(states)) == {"PrefillServer", "DecodeServer"}


def test_application_policy_through_rays_wrapper_keeps_state_between_ticks():
    from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config

    policy = _apply_app_level_autoscaling_config(planner.plan_application)
    metrics = {"PrefillServer": load(waiting=10), "DecodeServer": decode_metrics(ttft=2.0, queue=1.0, kv=0.1)}
    contexts = [make_context("PrefillServer", 2, metrics["PrefillServer"]),
                make_context("DecodeServer", 2, metrics["DecodeServer"])]
    decisions, states = policy({c.deployment_id: c for c in contexts})
    assert by_name(decisions) == {"PrefillServer": 4, "DecodeServer": 2}
    # The next tick, 10 s later and with the new replicas still starting: the state Ray kept holds it.
    later = {name: make_context(name, by_name(decisions)[name], metrics[name], current=2,
                                policy_state=by_name(states)[name], now=1010.0) for name in metrics}
    decisions, _ = policy({c.deployment_id: c for c in later.values()})
    assert by_name(decisions) == {"PrefillServer": 4, "DecodeServer": 2}


def test_deployment_policy_scales_one_role_within_its_share():
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    s = make_settings(initial_prefill=2, initial_decode=2)  # shares: 4 + 4 of 8
    policy = _apply_autoscaling_config(planner.plan_deployment)
    n, state = policy(make_context("DecodeServer", 3, decode_metrics(itl=0.3), settings=s))
    assert n == 4 and state[planner.STATE_KEY]["warned"]
    n, _ = policy(make_context("PrefillServer", 2, load(waiting=30), settings=s))
    assert n == 4


def test_deployment_policy_never_shrinks_while_ttft_misses_its_target():
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    # Decode alone cannot tell whether prefill causes slow first tokens, but it must not shrink.
    s = make_settings(initial_decode=3)
    policy = _apply_autoscaling_config(planner.plan_deployment)
    slow = make_context("DecodeServer", 3, decode_metrics(ttft=3.0, itl=0.001, kv=0.0), settings=s)
    assert policy(slow)[0] == 3
    fast = make_context("DecodeServer", 3, decode_metrics(ttft=0.1, itl=0.001, kv=0.0), settings=s)
    assert policy(fast)[0] == 2


def test_deployment_scaling_fixed_and_autoscaled():
    fixed = parse_cluster_args({"prefill_replicas": 3}, use_env=False)
    assert planner.deployment_scaling(fixed, "prefill") == {"num_replicas": 3}
    config = parse_cluster_args({"autoscale": True, "prefill_replicas": 2, "decode_replicas": 3,
                                 "max_total_replicas": 8, "min_replicas": 1, "max_replicas": 6,
                                 "target_ttft_s": 0.5}, use_env=False)
    scaling = planner.deployment_scaling(config, "decode")["autoscaling_config"]
    assert (scaling.min_replicas, scaling.max_replicas, scaling.initial_replicas) == (1, 6, 3)
    assert scaling.upscale_delay_s == 0 and scaling.downscale_delay_s == 0
    kwargs = scaling.policy.policy_kwargs
    assert kwargs["target_ttft_s"] == 0.5 and kwargs["max_total_replicas"] == 8 and kwargs["has_prefill"]
    policy = scaling.policy.get_policy()  # what the controller unpickles
    n, _ = policy(make_context("DecodeServer", 3, decode_metrics(), settings=PlannerSettings.from_kwargs(kwargs)))
    assert n == 4  # rule 9: decode holds its fixed share of the budget (8 x 3 // 5), prefill's 3 aside
    assert kwargs["hold_budget"] is True
    off = parse_cluster_args({"autoscale": True, "prefill_replicas": 2, "decode_replicas": 3, "max_total_replicas": 8,
                              "max_replicas": 6, "hold_budget": False}, use_env=False)
    kwargs = planner.deployment_scaling(off, "decode")["autoscaling_config"].policy.policy_kwargs
    assert kwargs["hold_budget"] is False
    n, _ = policy(make_context("DecodeServer", 3, decode_metrics(), settings=PlannerSettings.from_kwargs(kwargs)))
    assert n == 3


# --- what the replicas report --------------------------------------------------------------------------

class FakeWorker:
    """Stands in for DecodeWorker/PrefillWorker: fixed stats; three outputs per request."""

    def __init__(self, role: str) -> None:
        self.role = role

    def shutdown(self) -> None:
        pass

    async def stats(self, replica_id: str) -> ReplicaStats:
        return ReplicaStats(role=self.role, replica_id=replica_id, num_requests_running=3,
                            num_requests_waiting=1, kv_cache_usage_perc=0.25)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        first = StepOutput(request.request_id, [1], "a", timings={"prefill_queue": 0.2})
        yield first
        yield StepOutput(request.request_id, [2], "b")
        yield StepOutput(request.request_id, [3], "c", finish_reason="stop")


def test_decode_replicas_report_what_the_planner_reads():
    from cluster.decode.server import DecodeServer, DemandWindow, LatencyWindow

    server = object.__new__(DecodeServer.func_or_class)
    server.replica_id, server.worker = "d0", FakeWorker("decode")
    server.ttft, server.itl, server.prefill_queue = LatencyWindow(), LatencyWindow(), LatencyWindow()
    server.demand = DemandWindow(now=time.monotonic() - 10.0)  # up for 10 s

    async def run() -> dict[str, float]:
        request = GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=3))
        request.arrival_time -= 0.5
        assert len([out async for out in server.generate(request)]) == 3
        return await server.record_autoscaling_stats()

    reported = asyncio.run(run())
    assert set(reported) == {planner.WAITING, planner.KV_USAGE, planner.TTFT, planner.ITL, planner.PREFILL_QUEUE,
                             planner.ARRIVAL_RPS, planner.PROMPT_TOKENS, planner.OUTPUT_TOKENS, planner.ARRIVAL_CV2}
    assert reported[planner.TTFT] >= 0.5 and reported[planner.PREFILL_QUEUE] == 0.2
    # one request of 3 prompt tokens in the 10 s the replica has been up, 3 tokens out
    assert reported[planner.ARRIVAL_RPS] == pytest.approx(0.1, rel=0.01)
    assert reported[planner.PROMPT_TOKENS] == 3.0 and reported[planner.OUTPUT_TOKENS] == 3.0
    assert reported[planner.ARRIVAL_CV2] >= 0.0
    assert reported[planner.KV_USAGE] == 0.25 and all(isinstance(v, float) for v in reported.values())


def test_prefill_replicas_report_their_load():
    from cluster.prefill.server import PrefillServer

    server = object.__new__(PrefillServer.func_or_class)
    server.replica_id, server.worker = "p0", FakeWorker("prefill")
    reported = asyncio.run(server.record_autoscaling_stats())
    assert reported == {planner.WAITING: 1.0, planner.KV_USAGE: 0.25}


def test_latency_window_reports_a_recent_p90():
    from cluster.decode.server import LatencyWindow

    window = LatencyWindow(window_s=30.0)
    assert window.p90(now=0.0) == 0.0
    for i in range(1, 11):
        window.add(i / 10, now=float(i))
    assert window.p90(now=10.0) == 0.9
    assert window.p90(now=45.0) == 0.0  # all older than the window


def test_demand_window_reports_rate_and_token_means_of_its_window():
    from cluster.decode.server import DemandWindow

    window = DemandWindow(window_s=30.0, now=0.0)
    assert window.summary(now=0.0) == {"arrival_rps": 0.0, "prompt_tokens_mean": 0.0, "output_tokens_mean": 0.0,
                                       "arrival_rate_cv2": 0.0}
    for i in range(20):  # 2 requests a second for 10 s, prompts of 100 and 300 tokens
        window.arrive(100 if i % 2 else 300, now=i / 2)
    for i in range(5):
        window.complete(50, now=5.0 + i)
    got = window.summary(now=10.0)
    assert got == {"arrival_rps": 2.0, "prompt_tokens_mean": 200.0, "output_tokens_mean": 50.0,
                   "arrival_rate_cv2": 0.0}  # over 10 s up; evenly spaced: no burst
    assert window.summary(now=35.0)["arrival_rps"] == pytest.approx(10 / 30)  # those of the last 30 s
    assert window.summary(now=100.0)["arrival_rps"] == 0.0
    full = DemandWindow(window_s=30.0, max_samples=4, now=0.0)
    for i in range(10):
        full.arrive(10, now=20.0 + i)
    assert full.summary(now=29.0)["arrival_rps"] == pytest.approx(4 / 3)  # over the 3 s the kept samples span


def test_application_policy_sizes_from_the_replicas_demand():
    """Decode replicas' arrival rates are summed (each request is decoded by one), their token means
    weighted by rate; with a profile the planner predicts from them. 2 replicas x 2 req/s of 4,000
    prompt and 150 output tokens = 4 req/s: prefill 4 x 4,000 / (10,000 x 0.8) = 2, decode
    4 x 150 / (1,000 x 0.8) = 0.75 -> 1."""
    s = profiled(max_total_replicas=None)
    reports = {**decode_metrics(itl=0.05), planner.ARRIVAL_RPS: 2.0, planner.PROMPT_TOKENS: 4000.0,
               planner.OUTPUT_TOKENS: 150.0}
    decode = make_context("DecodeServer", 2, reports, settings=s)
    assert planner.demand(decode) == planner.Demand(4.0, 4000.0, 150.0)
    contexts = [make_context("PrefillServer", 4, load(), settings=s), decode]
    decisions, _ = planner.plan_application({c.deployment_id: c for c in contexts})
    assert by_name(decisions)["PrefillServer"] == 2
    # before any report, or with arrivals but no completion yet: no demand (reactive rules alone)
    assert planner.demand(make_context("DecodeServer", 2, decode_metrics(), settings=s)) is None
    waiting = make_context("DecodeServer", 2, {**reports, planner.OUTPUT_TOKENS: 0.0}, settings=s)
    assert planner.demand(waiting) is None
    idle = make_context("DecodeServer", 2, {**reports, planner.ARRIVAL_RPS: 0.0}, settings=s)
    assert planner.demand(idle) == planner.Demand(0.0, 0.0, 0.0)


# --- in Ray's controller ----------------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Deploys fake_app from a Serve config that names plan_application, in a Ray instance of its own,
#: and prints the replicas once the planner has moved one from decode to prefill (or time is up).
RAY_SCRIPT = """
import json, sys, time
import ray
from ray import serve
from ray.serve.schema import ServeDeploySchema
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[1])})
schema = ServeDeploySchema.model_validate({"applications": [{
    "name": "cluster", "route_prefix": "/", "import_path": "tests.router.test_planner:fake_app",
    "args": json.loads(sys.argv[2]),
    "autoscaling_policy": {"policy_function": "cluster.router.planner:plan_application"}}]})
serve.context._get_global_client().deploy_apps(schema, _blocking=False)
deadline, counts = time.time() + 180, {}
while time.time() < deadline:
    app = serve.status().applications.get("cluster")
    if app is not None and app.deployments:
        counts = {n: int(d.replica_states.get("RUNNING", 0)) for n, d in app.deployments.items()}
        if counts == {"PrefillServer": 5, "DecodeServer": 1}:
            break
    time.sleep(0.5)
print("COUNTS " + json.dumps(counts), flush=True)
serve.shutdown()
ray.shutdown()
"""


def fake_app(args: dict[str, Any]) -> Any:
    """Stand-ins for the two roles under their deployment names, sized by deployment_scaling as
    build_app sizes them: prefill-bound, decode idle. The TTFT they report is ``fake_ttft_s`` x the
    initial prefill replicas / the live ones (each prefill replica leaves a file named by its pid in
    ``fake_dir``, removed when it stops), so growing prefill pays, as the planner's rule 7 asks to
    see; with ``fake_ttft_fixed`` it stays put, and growth is futile."""
    from ray import serve

    ttft, fixed, where = float(args.pop("fake_ttft_s")), bool(args.pop("fake_ttft_fixed", False)), args.pop("fake_dir")
    config = parse_cluster_args(args, use_env=False)

    def live_prefill() -> int:
        alive = 0
        for name in os.listdir(where):
            try:  # a stopped replica's process may linger as a zombie: not alive
                with open(f"/proc/{int(name)}/stat") as f:
                    alive += f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
            except (OSError, ValueError, IndexError):
                pass
        return max(1, alive)

    @serve.deployment(name="PrefillServer", ray_actor_options={"num_cpus": 0})
    class Prefill:
        def __init__(self) -> None:
            self.mark = os.path.join(where, str(os.getpid()))
            open(self.mark, "w").close()

        def __del__(self) -> None:  # Serve calls it on a graceful stop (scale-down)
            try:
                os.remove(self.mark)
            except OSError:
                pass

        def record_autoscaling_stats(self) -> dict[str, float]:
            return {planner.WAITING: 0.0, planner.KV_USAGE: 0.1}

    @serve.deployment(name="DecodeServer", ray_actor_options={"num_cpus": 0})
    class Decode:
        def __init__(self, prefill: Any) -> None:
            self.prefill = prefill

        def record_autoscaling_stats(self) -> dict[str, float]:
            now = ttft if fixed else ttft * config.prefill_replicas / live_prefill()
            return {planner.WAITING: 0.0, planner.KV_USAGE: 0.05, planner.TTFT: now, planner.ITL: 0.001,
                    planner.PREFILL_QUEUE: 0.0}

    prefill = Prefill.options(**planner.deployment_scaling(config, "prefill")).bind()
    return Decode.options(**planner.deployment_scaling(config, "decode")).bind(prefill)


@pytest.mark.e2e
def test_ray_runs_the_planner_named_in_a_serve_config(tmp_path):
    args = {"fake_ttft_s": 3.0, "fake_dir": str(tmp_path), "autoscale": True, "prefill_replicas": 2, "decode_replicas": 2, "min_replicas": 1,
            "max_replicas": 5, "max_total_replicas": 6, "upscale_cooldown_s": 2, "downscale_cooldown_s": 4}
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])),
               RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S="0.5",
               RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S="0.5")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run([sys.executable, "-c", RAY_SCRIPT, str(port), json.dumps(args)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("COUNTS ")]
    assert lines, result.stdout[-3000:] + result.stderr[-3000:]
    # Prefill-bound: prefill grew 2 -> 4 (TTFT 3.0 -> 1.5: it paid) -> 5 and, at the budget of 6,
    # decode gave it one. The planner's state (rule 7's trials) went through Ray's policy state.
    assert json.loads(lines[-1].removeprefix("COUNTS ")) == {"PrefillServer": 5, "DecodeServer": 1}


def test_a_handover_under_the_budget_is_paced_by_the_replicas_starting():
    """With handover_starting_share, a role that grows by taking the other's GPUs takes at most
    that share of the budget while its new replicas start; the donor keeps the rest meanwhile
    (its replicas go on serving, where a moved one serves nobody until it is up)."""
    obs = with_demand(observe(2, 6), 24.0, 4000, 160)  # predicts prefill 5, decode 3 (see above)
    assert counts(plan(obs, profiled(handover_starting_share=None), PlannerState(), now=1000.0)) == (5, 3)  # all at once
    paced = profiled(handover_starting_share=0.25)  # 2 of the 8 may be starting
    first = plan(obs, paced, PlannerState(), now=1000.0)
    assert counts(first) == (4, 4) and "decode keeps 1" in first.reason
    starting = dataclasses.replace(obs, prefill=RoleLoad(4, ready_replicas=2, kv_usage=0.2),
                                   decode=RoleLoad(4, kv_usage=0.45))
    assert counts(plan(starting, paced, first.state, now=1010.0)) == (4, 4)  # two still starting: hold
    up = dataclasses.replace(starting, prefill=RoleLoad(4, ready_replicas=4, kv_usage=0.2))
    assert counts(plan(up, paced, first.state, now=1020.0)) == (5, 3)  # they are up: the rest moves
    # without a budget nothing is traded, so nothing is paced
    free = profiled(handover_starting_share=0.25, max_total_replicas=None)
    unpaced = plan(obs, profiled(max_total_replicas=None), PlannerState(), now=1000.0)
    assert counts(plan(obs, free, PlannerState(), now=1000.0)) == counts(unpaced) == (7, 6)


def test_growth_under_a_missed_target_waits_for_its_verdict_and_stays_when_it_paid():
    """Rule 7: prefill over its target grows 2 -> 4 and then grows no more until its new replicas
    have served payoff_window_s; the queue having fallen as two more replicas predict, it paid,
    and prefill grows again; decode does not shrink while the verdict is out."""
    s = make_settings()
    first = plan(observe(2, 4, ttft=3.0, queue=1.5, itl=0.01, kv=0.1), s, PlannerState(), now=1000.0)
    assert counts(first) == (4, 4) and first.state.trial("prefill")[2:5] == (2, 4, 3.0)
    starting = observe(4, 4, ttft=3.0, queue=1.5, itl=0.01, kv=0.1)
    starting = dataclasses.replace(starting, prefill=RoleLoad(4, ready_replicas=2, kv_usage=0.2))
    state = plan(starting, s, first.state, now=1040.0).state
    assert state.trial("prefill")[5] == -1.0  # not up yet: the clock has not started
    up = observe(4, 4, ttft=2.0, queue=1.0, itl=0.01, kv=0.1)
    waiting = plan(up, s, state, now=1050.0)  # up now; cooled, over target, yet held for its verdict
    assert counts(waiting) == (4, 4) and waiting.state.trial("prefill")[5] == 1050.0
    # pressure 3.0 -> 2.0: at most 3.0 x (1 - 0.5 x (1 - 2/4)) = 2.25 was asked: it paid; it grows again
    paid = plan(up, s, waiting.state, now=1080.0)
    assert paid.state.trial("prefill")[2:4] == (4, 6) and paid.replicas["prefill"] == 6
    assert not paid.state.holds
    # meeting the target ends a trial at once
    met = plan(observe(4, 4, ttft=0.5, queue=0.2, itl=0.01, kv=0.1), s, waiting.state, now=1055.0)
    assert met.state.trials == () and met.state.holds == ()


def test_futile_growth_goes_back_and_holds_until_the_mix_moves():
    """Rule 7, the simulator's bursty RAG lesson: bursts keep the prefill queue long at any pool
    size while decode replicas absorb them by prefilling locally. Growth that did not cut the
    pressure goes back (decode takes back what it gave) and prefill grows no more, nor decode
    shrinks, for futile_hold_s, unless the demand's mix moves."""
    s = profiled(handover_starting_share=None)
    obs = with_demand(observe(2, 6, ttft=3.0, queue=1.5, itl=0.01, kv=0.1), 4.0, 4000, 800)  # predicts prefill 2, decode 4
    first = plan(obs, s, PlannerState(), now=1000.0)
    assert counts(first) == (4, 4) and first.state.trial("prefill")[6] == 6  # decode gave two
    after = with_demand(observe(4, 4, ttft=2.8, queue=1.4, itl=0.01, kv=0.1), 4.0, 4000, 800)
    state = plan(after, s, first.state, now=1070.0).state  # all up: the window starts
    verdict = plan(after, s, state, now=1100.0)
    assert counts(verdict) == (2, 6) and "did not pay" in verdict.reason
    assert verdict.state.trials == () and verdict.state.held("prefill", 1100.0, after.demand, s) == (2, 6)
    back = with_demand(observe(2, 6, ttft=3.0, queue=1.5, itl=0.01, kv=0.1), 4.0, 4000, 800)
    held = plan(back, s, verdict.state, now=1200.0)
    assert counts(held) == (2, 6)  # over target and cooled, yet held; decode (predicted 4) keeps 6
    assert counts(plan(back, s, verdict.state, now=1100.0 + s.futile_hold_s)) == (4, 4)  # the hold expired
    moved = with_demand(observe(2, 6, ttft=3.0, queue=1.5, itl=0.01, kv=0.1), 4.0, 12_000, 800)
    assert plan(moved, s, verdict.state, now=1200.0).replicas["prefill"] > 2  # the mix moved: free to grow
    # the state round-trips through a policy state dict (Ray keeps it between ticks)
    assert PlannerState.from_dict(json.loads(json.dumps(dataclasses.asdict(verdict.state)))) == verdict.state
    assert PlannerState.from_dict(json.loads(json.dumps(dataclasses.asdict(first.state)))) == first.state
    # a pressure that more than doubled says prefill falls further behind (its queue grows every
    # interval: too few replicas, not bursts): no hold, it is free to grow again (here into a budget
    # of 12, decode keeping its predicted 4)
    behind = with_demand(observe(4, 4, ttft=7.0, queue=3.5, itl=0.01, kv=0.1), 4.0, 4000, 800)
    roomy = dataclasses.replace(s, max_total_replicas=12)
    rising = plan(behind, roomy, state, now=1100.0)
    assert rising.state.holds == () and "did not pay" not in rising.reason
    assert rising.replicas["prefill"] > 4 and rising.state.trial("prefill")[2] == 4
    # without a verdict window, growth is never judged
    off = profiled(handover_starting_share=None, payoff_window_s=None)
    assert plan(obs, off, PlannerState(), now=1000.0).state.trials == ()


def test_arrival_burstiness_is_the_rate_variation_beyond_poisson_noise():
    """arrival_rate_cv2 (what decode replicas report, and the simulator computes): about 0 for
    Poisson arrivals at any rate, about r - 1 for on/off bursts at r x the mean rate (the
    simulator's bursty phases: 3x for 5 s of every 15 s), also on a random share of them."""
    import random

    from cluster.common.reporting import arrival_rate_cv2

    rng = random.Random(0)
    for rate in (2.0, 20.0, 200.0):
        poisson, t = [], 0.0
        while t < 60.0:
            t += rng.expovariate(rate)
            poisson.append(t)
        assert arrival_rate_cv2(poisson, 60.0, 60.0) < 0.15
        bursts = [t for t in (rng.uniform(0, 60.0) for _ in range(int(rate * 60))) if t % 15.0 < 5.0]
        share = [t for t in bursts if rng.random() < 0.25]  # one replica's share of the cluster's arrivals
        assert arrival_rate_cv2(bursts, 60.0, 60.0) == pytest.approx(2.0, abs=0.5)
        if rate > 2.0:
            assert arrival_rate_cv2(share, 60.0, 60.0) == pytest.approx(2.0, abs=0.7)
    assert arrival_rate_cv2([], 60.0, 60.0) == 0.0 and arrival_rate_cv2([1.0], 2.0, 2.0) == 0.0  # too few bins
    # the application policy weighs each replica's value by its arrival rate
    reports = {**decode_metrics(itl=0.05), planner.ARRIVAL_RPS: 2.0, planner.PROMPT_TOKENS: 4000.0,
               planner.OUTPUT_TOKENS: 150.0, planner.ARRIVAL_CV2: 2.0}
    ctx = make_context("DecodeServer", 2, reports, settings=profiled())
    assert planner.demand(ctx).rate_cv2 == pytest.approx(2.0)


def test_bursty_arrivals_size_prefill_for_the_rate_between_bursts():
    """Rule 8, the simulator's bursty RAG lesson (on/off bursts of 3x the mean rate): a prefill
    pool sized for the mean idles between bursts and is swamped in them, while decode replicas
    absorb bursts by prefilling locally; the best fixed splits had the fewest prefill replicas.
    Bursty demand sizes prefill for the rate one standard deviation below the mean and adds the
    rest of the prompt work to decode's need."""
    s = profiled(max_total_replicas=None, max_prefill=16, max_decode=16)
    steady = with_demand(observe(2, 2), 8.0, 4000, 300)  # prefill 8 x 4,000 / 8,000 = 4, decode 3
    assert planner.predict(steady, s) == {"prefill": 4, "decode": 3}
    mild = dataclasses.replace(steady, demand=dataclasses.replace(steady.demand, rate_cv2=0.3))
    assert planner.predict(mild, s) == {"prefill": 4, "decode": 3}  # under bursty_cv2: Poisson noise
    bursty = dataclasses.replace(steady, demand=dataclasses.replace(steady.demand, rate_cv2=0.64))
    # the rate 0.8 sigma below: prefill 4 x 0.2 = 0.8 -> 1; decode 3 + 3.2 = 6.2 -> 7
    assert planner.predict(bursty, s) == {"prefill": 1, "decode": 7}
    on_off = dataclasses.replace(steady, demand=dataclasses.replace(steady.demand, rate_cv2=2.0))
    assert planner.predict(on_off, s) == {"prefill": 1, "decode": 7}  # nothing between bursts: the floor
    assert planner.predict(on_off, profiled(max_total_replicas=None, bursty_cv2=None,
                                            max_prefill=16, max_decode=16)) == {"prefill": 4, "decode": 3}


def test_a_deployed_role_that_has_not_reported_blocks_a_slack_shrink():
    """Seen in Ray: at start-up prefill reported an empty queue before decode's latencies arrived,
    so prefill looked idle and shed a replica, then grew it back a moment later. A role whose
    replicas run (ready_replicas known) but have not reported is no evidence of slack; the
    deployment-level policy's stand-in for the other role (no replicas known) does not block."""
    s = make_settings()
    quiet = Observation(prefill=RoleLoad(2, ready_replicas=2, kv_usage=0.0), decode=RoleLoad(2, ready_replicas=2, reported=False),
                        ttft_s=0.0, itl_s=0.0, prefill_queue_s=0.0)
    assert counts(plan(quiet, s, PlannerState(), now=1000.0)) == (2, 2)
    reported = dataclasses.replace(quiet, decode=RoleLoad(2, ready_replicas=2, kv_usage=0.0))
    assert counts(plan(reported, s, PlannerState(), now=1000.0)) != (2, 2)  # both idle and heard: one goes
    stand_in = dataclasses.replace(quiet, decode=RoleLoad(2, reported=False))
    assert counts(plan(stand_in, s, PlannerState(), now=1000.0)) == (1, 2)


# --- rule 9: decode holds what the budget leaves -------------------------------------------------------

def test_decode_holds_the_gpus_of_the_budget_prefill_does_not():
    """Rule 9 (``hold_budget``): under max_total_replicas, the GPUs neither role needs stay held as
    decode replicas, so nothing of the budget idles; within decode's bounds; without a budget, or
    turned off, nothing is added."""
    s = make_settings(hold_budget=True)
    steady = plan(observe(2, 2), s, PlannerState(), now=1000.0)
    assert counts(steady) == (2, BUDGET - 2) and "decode holds 4 spare of the budget" in steady.reason
    assert counts(plan(observe(2, 2), make_settings(hold_budget=True, max_decode=5), PlannerState(), 1000.0)) == (2, 5)
    assert counts(plan(observe(2, 2), make_settings(hold_budget=True, max_total_replicas=None),
                       PlannerState(), 1000.0)) == (2, 2)
    assert counts(plan(observe(2, 2), make_settings(), PlannerState(), 1000.0)) == (2, 2)  # turned off


def test_with_the_budget_held_idle_prefill_shrinks_and_decode_takes_its_gpus():
    """Idle, prefill gives back a replica per cooldown as before; decode, which holds the rest of
    the budget, never has slack to give and takes each GPU prefill lets go: the count stays the
    budget and decode only grows."""
    s = make_settings(hold_budget=True)
    p, d, state = 4, 4, PlannerState()
    seen: list[tuple[int, int]] = []
    for tick in range(200):
        decision = plan(observe(p, d, ttft=0.0, itl=0.0, queue=0.0, kv=0.0), s, state, 1000.0 + 10.0 * tick)
        (p, d), state = counts(decision), decision.state
        seen.append((p, d))
    assert (p, d) == (1, BUDGET - 1)
    assert all(a + b == BUDGET for a, b in seen)
    assert all(b2 >= b1 for (_, b1), (_, b2) in zip(seen, seen[1:]))


def test_with_the_budget_held_prefill_still_grows_by_taking_decodes_gpus():
    """Prefill over its target at the budget takes replicas from decode (rule 3) as before: the
    held GPUs are where its growth comes from."""
    decision = plan(observe(2, 6, ttft=2.0, queue=1.2, itl=0.01, kv=0.1), make_settings(hold_budget=True),
                    PlannerState(), now=1000.0)
    p, d = counts(decision)
    assert p > 2 and p + d == BUDGET and "decode gives" in decision.reason
