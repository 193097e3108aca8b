"""The planner: scales prefill and decode replicas separately so that p90 time to first token
(TTFT) and inter-token latency (ITL) stay under their targets at the fewest GPUs, moving replicas
between the two roles when they share a GPU budget (``max_total_replicas``; within one, decode
holds what prefill does not need: rule 9).

The core, ``plan``, is pure (observations, settings and cooldown state in; replica counts and new
state out) and needs no Ray. Two Ray Serve adapters call it:
- ``plan_application``, the application-level autoscaling policy (Ray >= 2.60: a function from
  ``{DeploymentID: AutoscalingContext}`` to ``({DeploymentID: replicas}, {DeploymentID: state})``).
  Ray takes application-level policies only from a Serve config file::

      applications:
      - import_path: cluster.app
        args: {autoscale: true, max_total_replicas: 8}
        autoscaling_policy: {policy_function: cluster.router.planner:plan_application}

- ``plan_deployment``, the deployment-level policy that ``deployment_scaling`` gives both roles; Ray
  uses it when no application-level policy is set (``serve run cluster.app autoscale=true``). Each
  role then scales alone within a fixed share of the budget, and prefill sees only its queue.
``deployment_scaling`` also carries the settings to both adapters, as the policy's kwargs.

Replicas report their load through ``record_autoscaling_stats`` (the metric names below); decode
replicas also report recent p90 TTFT, ITL and prefill queue time. Each signal over its target is
a *pressure*; above 1 a role misses its target:
- prefill: queue time / (prefill_queue_share x target TTFT), requests waiting per replica /
  max_waiting_per_replica, and TTFT / target TTFT unless decode is over its own target;
- decode: ITL / target ITL, KV cache usage / high_kv_usage, requests waiting per replica, and
  TTFT / target TTFT when decode is over its own target (its admission then delays first tokens).

Rules: (1) hold a role that has not reported or whose new replicas are still starting; (2) a role
over its target grows (at most doubling) unless it grew within upscale_cooldown_s; (3) over the
budget, the other role gives replicas (at most half of its own) if it did not grow within
downscale_cooldown_s and its pressure, spread over fewer replicas, stays under donor_headroom; the
rest of the growth is cut;
(4) when no role is over, TTFT and ITL meet their targets and nothing changed within
downscale_cooldown_s, the role with the most slack (pressure under ``slack``, same prediction as
3) gives back one replica; (5) a role that grows by taking the other's GPUs has at most
``handover_starting_share`` of the budget starting at once, the donor keeping (and serving on)
the rest until those replicas are up; (6) with a profile (``predict``), a role shrinks only to the
most it was predicted to need over ``downscale_window_s``, unless the other role grows in the same
decision; (7) growth made while a role misses its target must be seen to pay: the role grows no
more until its new replicas have served for ``payoff_window_s``; then, if it still misses and its
pressure has neither fallen by ``payoff_share`` of what spreading the load over the new count
predicts nor risen past ``behind_rise`` x (the role still falling behind), the growth was futile
(arrivals in bursts that no pool size absorbs keep the prefill queue long at any size, while
decode replicas absorb them by prefilling locally): the role returns to its count before the
growth, the other role takes the replicas back, and for ``futile_hold_s`` the role does
not grow nor the other shrink, unless the demand's mix moves; while prefill is so held, TTFT is
decode's pressure (its replicas prefill locally); (8) with a profile and bursty arrivals
(``bursty_cv2``), prefill is sized for the rate between bursts and decode for the rest of the
prompt work as well as its own; (9) under max_total_replicas (``hold_budget``), decode holds every
GPU of the budget prefill does not (a role whose growth awaits its verdict excepted), so nothing
of the budget idles and decode's count follows prefill's."""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingContext

    from cluster.config import ClusterConfig

logger = logging.getLogger("ray.serve")

Role = Literal["prefill", "decode"]
#: Serve deployment name -> role.
DEPLOYMENTS: dict[str, Role] = {"PrefillServer": "prefill", "DecodeServer": "decode"}
#: Metrics every replica reports through ``record_autoscaling_stats``.
WAITING, KV_USAGE = "num_requests_waiting", "kv_cache_usage_perc"
#: Metrics decode replicas add: recent p90s, in seconds (0 when there were no samples).
TTFT, ITL, PREFILL_QUEUE = "ttft_p90_seconds", "itl_p90_seconds", "prefill_queue_p90_seconds"
#: ...and what arrived at them over the same window (cluster.decode.server.DemandWindow): the
#: planner's Demand, summed over the decode replicas.
ARRIVAL_RPS, PROMPT_TOKENS, OUTPUT_TOKENS = "arrival_rps", "prompt_tokens_mean", "output_tokens_mean"
#: ...and how bursty those arrivals are (cluster.common.reporting.arrival_rate_cv2).
ARRIVAL_CV2 = "arrival_rate_cv2"
#: Key of the planner's state in each deployment's Ray policy state.
STATE_KEY = "pd_planner"
#: Ray averages each replica's reports over this window.
LOOK_BACK_S = 20.0


@dataclass(frozen=True)
class PlannerSettings:
    target_ttft_s: float = 1.0
    target_itl_s: float = 0.1
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    #: Prefill + decode replicas together; None: no joint cap.
    max_total_replicas: int | None = None
    upscale_cooldown_s: float = 30.0
    downscale_cooldown_s: float = 120.0
    #: Starting replicas; they set each role's fixed share of the budget in plan_deployment.
    initial_prefill: int = 1
    initial_decode: int = 1
    #: False: no prefill role (decode prefills every prompt and owns TTFT).
    has_prefill: bool = True
    high_kv_usage: float = 0.9
    max_waiting_per_replica: float = 8.0
    #: Share of the TTFT target that prefill queueing may use.
    prefill_queue_share: float = 0.5
    #: A role scales down only under this pressure...
    slack: float = 0.5
    #: ...and gives or sheds replicas only if its pressure over fewer replicas stays under this.
    donor_headroom: float = 0.8
    #: Profiled capacity of one replica, for predictive sizing (None: reactive rules only): prompt
    #: tokens per second a prefill replica computes, output tokens per second a decode replica
    #: generates within the ITL target, and the KV tokens a decode replica holds.
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    decode_kv_tokens: float | None = None
    #: Predictive sizing aims each role at this share of its profiled capacity...
    target_utilization: float = 0.8
    #: ...and moves a role only when the prediction is this share (and at least one replica) away.
    hysteresis: float = 0.1
    #: Predictive sizing adds the requests already waiting (a backlog built while new replicas
    #: started) as demand on both roles, to clear within this many seconds (None: arrivals only).
    backlog_drain_s: float | None = 60.0
    #: Under max_total_replicas a role grows only by taking the other role's GPUs, and each one
    #: moved serves nobody until its new replica has started. At most this share of the budget
    #: may be starting at once in a role that takes from the other (the donor keeps the rest
    #: until those are up: a decode replica keeps decoding, and prefilling locally, meanwhile);
    #: None: the whole move at once. 0.15 from the simulator (bench/simulate.py at 8 and 64 GPUs,
    #: three seeds: 0.1 and 0.125 flap in the code phase, 0.2 and 0.25 leave RAG short again).
    handover_starting_share: float | None = 0.15
    #: A role the prediction shrinks goes down only to the most it was predicted to need over this
    #: window (Kubernetes' scale-down stabilisation), unless the other role grows in the same
    #: decision (the mix moved): a dip in one demand window (10 s in the simulator) otherwise
    #: shrank decode and grew it back an interval later, each new replica a start-up. 60 s from
    #: the simulator (bench/simulate.py, 8 and 64 GPUs, seed 1 flapped without it).
    downscale_window_s: float = 60.0
    #: Arrivals whose rate varies more than this (squared coefficient of variation, beyond Poisson
    #: noise) are bursty: the prediction sizes prefill for the rate one standard deviation below
    #: the mean (a pool sized for the mean idles between bursts and is swamped in them) and adds
    #: the rest of the prompt work to decode, whose replicas prefill it locally, as colocated ones
    #: would. None: steady sizing always. 0.5 from the simulator (bench/simulate.py --bursty:
    #: Poisson windows read 0-0.1, its on/off bursts 2).
    bursty_cv2: float | None = 0.5
    #: Growth made while a role misses its target is judged once its new replicas have served this
    #: long (the p90s cover the last ~30 s); the role grows no more meanwhile. None: never judged.
    payoff_window_s: float | None = 30.0
    #: ...it paid if the pressure fell by at least this share of what spreading the load over the
    #: new count predicts (p x old / new), or the role meets its target again...
    payoff_share: float = 0.5
    #: ...otherwise it was futile: the role goes back to its old count and grows no more (and the
    #: other role does not shrink) for this long, unless the prompt or output mean moves by more
    #: than ``mix_shift`` from what it was then (a demand window between bursts holds few requests:
    #: its means stray by a third). From the simulator's bursty phases (bench/simulate.py --bursty).
    futile_hold_s: float = 300.0
    mix_shift: float = 0.5
    #: A pressure that rose past this multiple of its value at the growth is not futile growth but
    #: a role still falling behind (its queue grows every interval: too few replicas, not bursts):
    #: the verdict frees it to grow again.
    behind_rise: float = 2.0
    #: Under max_total_replicas, the GPUs neither role's demand needs stay held as decode replicas
    #: (rule 9): they absorb bursts by prefilling locally, and a shift in the mix finds them
    #: running instead of waiting out a start-up, as a fixed split's would. False: they are given
    #: back (Ray frees them for other work). From the simulator (bench/simulate.py --bursty: at 64
    #: GPUs a planner that entered a bursty RAG phase holding the 54 GPUs chat needed lost a
    #: start-up's worth of goodput to every fixed split, which starts each phase with all 64).
    hold_budget: bool = True

    def bounds(self, role: Role) -> tuple[int, int]:
        return (self.min_prefill, self.max_prefill) if role == "prefill" else (self.min_decode, self.max_decode)

    def with_bounds(self, role: Role, low: int, high: int) -> PlannerSettings:
        if role == "prefill":
            return dataclasses.replace(self, min_prefill=low, max_prefill=high)
        return dataclasses.replace(self, min_decode=low, max_decode=high)

    def share(self, role: Role) -> int:
        """The most replicas ``role`` may hold when the roles do not trade (plan_deployment)."""
        high = self.bounds(role)[1]
        if self.max_total_replicas is None:
            return high
        initial = self.initial_prefill if role == "prefill" else self.initial_decode
        total = self.initial_decode + (self.initial_prefill if self.has_prefill else 0)
        return min(high, self.max_total_replicas * initial // total)

    @classmethod
    def from_config(cls, config: ClusterConfig) -> PlannerSettings:
        return cls(target_ttft_s=config.target_ttft_s, target_itl_s=config.target_itl_s,
                   min_prefill=config.min_replicas, max_prefill=config.max_replicas,
                   min_decode=config.min_replicas, max_decode=config.max_replicas,
                   max_total_replicas=config.max_total_replicas,
                   upscale_cooldown_s=config.upscale_cooldown_s, downscale_cooldown_s=config.downscale_cooldown_s,
                   hold_budget=config.hold_budget,
                   initial_prefill=config.prefill_replicas, initial_decode=config.decode_replicas,
                   has_prefill=config.prefill_replicas > 0 and config.transfer.backend != "local")

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> PlannerSettings:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in kwargs.items() if k in names})


@dataclass(frozen=True)
class RoleLoad:
    """One role's load: means per reporting replica, KV usage of the fullest replica."""

    #: Replicas the role is meant to have now (the count a decision changes).
    replicas: int
    #: Replicas running now; fewer than ``replicas`` while new ones start.
    ready_replicas: int | None = None
    #: False until some replica of the role has reported.
    reported: bool = True
    waiting: float = 0.0
    kv_usage: float = 0.0

    @property
    def starting(self) -> bool:
        return self.ready_replicas is not None and self.ready_replicas < self.replicas


@dataclass(frozen=True)
class Demand:
    """What the router saw arrive over the recent window: the inputs of DistServe's and Dynamo's
    planners. Output length is of recent completions (it is known only at the end)."""

    arrival_rps: float
    prompt_tokens: float
    output_tokens: float
    #: The arrival rate's squared coefficient of variation beyond Poisson noise (0: steady).
    rate_cv2: float = 0.0


@dataclass(frozen=True)
class Observation:
    decode: RoleLoad
    #: None: the application has no prefill role.
    prefill: RoleLoad | None = None
    #: Recent p90s in seconds, as decode replicas measure them (0: no samples).
    ttft_s: float = 0.0
    itl_s: float = 0.0
    prefill_queue_s: float = 0.0
    #: None: no demand measured (the reactive rules alone decide).
    demand: Demand | None = None

    def loads(self) -> dict[Role, RoleLoad]:
        if self.prefill is None:
            return {"decode": self.decode}
        return {"prefill": self.prefill, "decode": self.decode}


@dataclass(frozen=True)
class PlannerState:
    """When each role last grew and shrank (seconds, the clock of ``now``; None: never), and the
    recent predictions ``(time, prefill, decode)`` (-1: no such role) within downscale_window_s."""

    prefill_up: float | None = None
    prefill_down: float | None = None
    decode_up: float | None = None
    decode_down: float | None = None
    predictions: tuple[tuple[float, int, int], ...] = ()
    #: Growth under a missed target awaiting its verdict (rule 7): ``(role, time, replicas before,
    #: replicas after, pressure then, time its replicas were first seen all ready or -1, the other
    #: role's replicas before (-1: no other role))``.
    trials: tuple[tuple[str, float, int, int, float, float, int], ...] = ()
    #: Futile growth: ``(role, until, the count it goes back to, the other role's count to restore
    #: (-1: none), prompt and output means then (-1: unknown))``.
    holds: tuple[tuple[str, float, int, int, float, float], ...] = ()

    def last_up(self, role: Role) -> float | None:
        return self.prefill_up if role == "prefill" else self.decode_up

    def last_change(self) -> float | None:
        times = [t for t in (self.prefill_up, self.prefill_down, self.decode_up, self.decode_down) if t is not None]
        return max(times) if times else None

    def predicted_most(self, role: Role) -> int | None:
        """The most ``role`` was predicted to need in the window kept (None: no prediction)."""
        counts = [p[1] if role == "prefill" else p[2] for p in self.predictions]
        return max(counts) if counts else None

    def with_prediction(self, predicted: dict[Role, int], now: float, window_s: float) -> PlannerState:
        kept = tuple(p for p in self.predictions if now - p[0] < window_s)
        entry = (now, predicted.get("prefill", -1), predicted.get("decode", -1))
        return dataclasses.replace(self, predictions=kept + (entry,))

    def changed(self, role: Role, delta: int, now: float) -> PlannerState:
        if delta == 0:
            return self
        return dataclasses.replace(self, **{f"{role}_{'up' if delta > 0 else 'down'}": now})

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> PlannerState:
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in (data or {}).items() if k in names}
        if "predictions" in fields:  # JSON-like policy state holds lists
            fields["predictions"] = tuple((float(t), int(p), int(d)) for t, p, d in fields["predictions"])
        if "trials" in fields:
            fields["trials"] = tuple((str(r), float(t), int(n), int(m), float(p), float(ready), int(o))
                                     for r, t, n, m, p, ready, o in fields["trials"])
        if "holds" in fields:
            fields["holds"] = tuple((str(r), float(u), int(n), int(o), float(pt), float(ot))
                                    for r, u, n, o, pt, ot in fields["holds"])
        return cls(**fields)

    def trial(self, role: Role) -> tuple[str, float, int, int, float, float, int] | None:
        return next((t for t in self.trials if t[0] == role), None)

    def held(self, role: Role, now: float, demand: Demand | None, s: PlannerSettings) -> tuple[int, int] | None:
        """The counts futile growth holds ``role`` to and restores the other role to (rule 7),
        within futile_hold_s and while the mix has not moved; None: not held."""
        for r, until, count, other, prompt, output in self.holds:
            if r != role or now >= until:
                continue
            if demand is None or prompt < 0 or demand.output_tokens <= 0:
                return count, other
            moved = max(abs(demand.prompt_tokens - prompt) / max(prompt, 1.0),
                        abs(demand.output_tokens - output) / max(output, 1.0))
            if moved <= s.mix_shift:
                return count, other
        return None


@dataclass(frozen=True)
class Decision:
    replicas: dict[Role, int]
    state: PlannerState
    #: Pressure per role (None: no data), for logs and tests.
    pressure: dict[Role, float | None]
    #: What changed and why; empty when nothing did.
    reason: str = ""


# --- the core -----------------------------------------------------------------------------------

def pressures(obs: Observation, s: PlannerSettings) -> dict[Role, float | None]:
    ttft = obs.ttft_s / s.target_ttft_s
    d = obs.decode
    decode = max(obs.itl_s / s.target_itl_s, d.kv_usage / s.high_kv_usage,
                 d.waiting / s.max_waiting_per_replica) if d.reported else None
    if obs.prefill is None:
        return {"decode": None if decode is None else max(decode, ttft)}
    p = obs.prefill
    prefill = max(obs.prefill_queue_s / (s.prefill_queue_share * s.target_ttft_s),
                  p.waiting / s.max_waiting_per_replica) if p.reported else None
    if decode is not None and decode > 1.0:
        decode = max(decode, ttft)
    elif prefill is not None:
        prefill = max(prefill, ttft)
    return {"prefill": prefill, "decode": decode}


def plan(obs: Observation, s: PlannerSettings, state: PlannerState, now: float) -> Decision:
    """Desired replicas per role for this observation (see the module docstring for the rules)."""
    loads = obs.loads()
    pressure = pressures(obs, s)
    want = {role: _clamp(load.replicas, s.bounds(role)) for role, load in loads.items()}
    notes: list[str] = []
    state = _judge_growth(obs, loads, pressure, s, state, now, notes)
    # rule 7: a role whose growth awaits its verdict, or was futile, does not grow, and the other
    # role does not shrink meanwhile (it carries what that growth may not)
    held = {r: state.held(r, now, obs.demand, s) for r in loads}
    frozen = {r for r in loads if state.trial(r) is not None or held[r] is not None}
    kept = {_other(r) for r in frozen} & set(loads)
    if held.get("prefill") is not None and pressure["decode"] is not None:
        # prefill's growth did not cut TTFT: decode replicas, which prefill locally, carry it now
        pressure["decode"] = max(pressure["decode"], obs.ttft_s / s.target_ttft_s)
    predicted = predict(obs, s)
    if predicted is not None:
        state = state.with_prediction(predicted, now, s.downscale_window_s)
        predicted = {r: min(n, loads[r].replicas) if r in frozen else max(n, loads[r].replicas) if r in kept else n
                     for r, n in predicted.items()}
        notes += _follow_prediction(want, predicted, loads, pressure, s, state, now)
    for role, load in loads.items():
        p = pressure[role]
        cooled = _since(state.last_up(role), now) >= s.upscale_cooldown_s
        grown = predicted is not None and want[role] > load.replicas  # the prediction already grew it
        if p is not None and p > 1.0 and not load.starting and cooled and not grown and role not in frozen:
            step = max(1, math.ceil(load.replicas * min(p - 1.0, 1.0)))
            want[role] = min(s.bounds(role)[1], max(want[role], load.replicas + step))
    for role, counts in held.items():  # back to the counts before the futile growth
        if counts is None:
            continue
        count, other_count = max(counts[0], s.bounds(role)[0]), counts[1]
        want[role] = min(want[role], count)
        other = _other(role)
        if other in want and other_count > want[other]:  # the other takes back what it gave, room allowing
            room = math.inf if s.max_total_replicas is None else s.max_total_replicas - sum(want.values())
            want[other] = min(s.bounds(other)[1], want[other] + max(0, min(other_count - want[other], room)))
    notes += _fit_budget(want, loads, pressure, state, s, now, predicted)
    notes += _pace_handover(want, loads, s)
    for role in frozen:
        want[role] = min(want[role], max(loads[role].replicas, s.bounds(role)[0]))
    # Nothing shrinks while users see a missed target, even one no role here can act on.
    nothing_over = (all(p is None or p <= 1.0 for p in pressure.values())
                    and obs.ttft_s <= s.target_ttft_s and obs.itl_s <= s.target_itl_s)
    if (predicted is None and nothing_over and all(want[r] == loads[r].replicas for r in loads)
            # no data is not idle: a deployed role (its running replicas known) that has not
            # reported yet blocks it (plan_deployment's stand-in for the other role counts none)
            and all(load.reported or load.ready_replicas is None for load in loads.values())
            and _since(state.last_change(), now) >= s.downscale_cooldown_s):
        idle = [r for r in loads if r not in kept and not (r == "decode" and _holds_budget(s))
                and _has_slack(r, loads[r], pressure[r], state, s, now)]
        if idle:
            role = min(idle, key=lambda r: pressure[r] or 0.0)
            want[role] -= 1
            notes.append(f"{role} has slack")
    if _holds_budget(s) and "decode" in want and "decode" not in frozen:  # rule 9
        assert s.max_total_replicas is not None
        spare = min(s.max_total_replicas - sum(want.values()), s.bounds("decode")[1] - want["decode"])
        if spare > 0:
            want["decode"] += spare
            notes.append(f"decode holds {spare} spare of the budget")
    new_state = state
    changes = []
    for role, load in loads.items():
        new_state = new_state.changed(role, want[role] - load.replicas, now)
        p = pressure[role]
        if (s.payoff_window_s is not None and want[role] > load.replicas and p is not None and p > 1.0
                and role not in kept):  # rule 7: growth under a missed target awaits its verdict
            other = loads.get(_other(role))
            new_state = dataclasses.replace(new_state, trials=new_state.trials + (
                (role, now, load.replicas, want[role], p, -1.0, other.replicas if other is not None else -1),))
        if want[role] != load.replicas:
            changes.append(f"{role} {load.replicas}->{want[role]} (pressure {_fmt(pressure[role])})")
    reason = "; ".join(changes + notes) if changes else ""
    return Decision(want, new_state, pressure, reason)


def predict(obs: Observation, s: PlannerSettings) -> dict[Role, int] | None:
    """Replicas each role needs for the measured demand at ``target_utilization`` of its profiled
    capacity, as DistServe's and Dynamo's planners size them: arrival rate x tokens per request /
    tokens per second of one replica; decode also by KV (Little's law: requests decoding at once =
    arrival rate x output tokens x ITL, each holding prompt + output tokens); both also by the
    backlog, as extra arrivals to clear within ``backlog_drain_s`` (at 0.8 utilisation the spare
    fifth of capacity alone takes minutes to clear what piled up over one replica start-up). Over
    ``max_total_replicas`` the budget is split in proportion to need. None: no demand or profile."""
    d = obs.demand
    has_prefill = obs.prefill is not None
    if d is None or not s.decode_tokens_per_s or (has_prefill and not s.prefill_tokens_per_s):
        return None
    u = s.target_utilization
    # the backlog (requests waiting to be prefilled) is demand on both roles, to clear within backlog_drain_s
    queued_rps = backlog(obs) / s.backlog_drain_s if s.backlog_drain_s else 0.0
    need: dict[Role, float] = {"decode": (d.arrival_rps + queued_rps) * d.output_tokens / (s.decode_tokens_per_s * u)}
    if s.decode_kv_tokens:
        itl = min(obs.itl_s, s.target_itl_s) if obs.itl_s > 0 else s.target_itl_s
        live = d.arrival_rps * d.output_tokens * itl
        need["decode"] = max(need["decode"], live * (d.prompt_tokens + d.output_tokens) / (s.decode_kv_tokens * u))
    prefill = ((d.arrival_rps + queued_rps) * d.prompt_tokens / (s.prefill_tokens_per_s * u)
               if s.prefill_tokens_per_s else 0.0)
    if has_prefill:
        need["prefill"] = prefill
        if s.bursty_cv2 is not None and d.rate_cv2 > s.bursty_cv2:  # bursts: decode prefills the excess locally
            base = prefill * max(0.0, 1.0 - math.sqrt(d.rate_cv2)) if d.arrival_rps > 0 else 0.0
            need["prefill"], need["decode"] = base, need["decode"] + prefill - base
    else:  # decode replicas prefill every prompt too
        need["decode"] += prefill
    want = {r: _clamp(max(1, math.ceil(n - 1e-9)), s.bounds(r)) for r, n in need.items()}
    budget = s.max_total_replicas
    if budget is not None and sum(want.values()) > budget:
        total = sum(need.values())
        want = {r: _clamp(math.floor(budget * n / total), s.bounds(r)) for r, n in need.items()}
        while sum(want.values()) < budget:  # the rest to whoever is furthest below its need
            r = max(want, key=lambda r: need[r] / max(want[r], 1e-9) if want[r] < s.bounds(r)[1] else -1.0)
            if want[r] >= s.bounds(r)[1]:
                break
            want[r] += 1
        while sum(want.values()) > budget:  # bounds' floors pushed it over
            r = max(want, key=lambda r: want[r] - s.bounds(r)[0])
            want[r] -= 1
    return want


def backlog(obs: Observation) -> float:
    """Requests waiting, not yet prefilled: for decode room and at (or for) a prefill replica."""
    def total(load: RoleLoad | None) -> float:
        if load is None or not load.reported:
            return 0.0
        return load.waiting * max(1, load.ready_replicas if load.ready_replicas is not None else load.replicas)
    return total(obs.decode) + total(obs.prefill)


def _judge_growth(obs: Observation, loads: dict[Role, RoleLoad], pressure: dict[Role, float | None],
                  s: PlannerSettings, state: PlannerState, now: float, notes: list[str]) -> PlannerState:
    """Rule 7's verdicts: a trial ends paid once the role meets its target again, or when, its new
    replicas having served payoff_window_s, its pressure fell to within payoff_share of what spreading
    the load over them predicts; otherwise futile: the role is held to its count before the growth.
    A role that shrank below the trial's count since ends it. Holds expire."""
    trials, holds = [], [h for h in state.holds if h[1] > now]
    for trial in state.trials:
        role, grown_at, before, after, p_then, ready_at, other_before = trial
        load, p = loads.get(role), pressure.get(role)  # type: ignore[call-overload]
        if load is None or s.payoff_window_s is None or load.replicas < after or (p is not None and p <= 1.0):
            continue
        if ready_at < 0:
            if load.starting or not load.reported:
                trials.append(trial)
                continue
            ready_at = now
        if p is None or now - ready_at < s.payoff_window_s:
            trials.append((role, grown_at, before, after, p_then, ready_at, other_before))
            continue
        expected = p_then * (1.0 - s.payoff_share * (1.0 - before / after))
        if p <= expected or p > s.behind_rise * p_then:  # paid, or still too small: free to grow
            continue
        d = obs.demand
        holds.append((role, now + s.futile_hold_s, before, other_before,
                      d.prompt_tokens if d else -1.0, d.output_tokens if d else -1.0))
        notes.append(f"{role}'s growth {before}->{after} did not pay (pressure {p_then:.2f} -> {p:.2f}, "
                     f"paying would be <= {expected:.2f})")
    return dataclasses.replace(state, trials=tuple(trials), holds=tuple(holds))


def _follow_prediction(want: dict[Role, int], predicted: dict[Role, int], loads: dict[Role, RoleLoad],
                       pressure: dict[Role, float | None], s: PlannerSettings, state: PlannerState | None = None,
                       now: float = 0.0) -> list[str]:
    """Grow each role to its predicted count at once (even while replicas start: the prediction is
    a count, not a step); shrink it only when the prediction is more than the hysteresis band
    below, and never while the role misses its target. A role that grew within
    downscale_cooldown_s shrinks only when the other role grows in the same decision (the mix
    shifted): a short demand window's noise alone would otherwise flap it (grow, shrink, grow: each
    new replica a start-up); otherwise it shrinks only to the most it was predicted to need over
    downscale_window_s (``state.predictions``). When one role's growth needs the budget, the
    other comes down to its prediction whatever the band."""
    notes = []
    growing = {r for r in loads if predicted[r] > loads[r].replicas}
    for role, load in loads.items():
        target, n = predicted[role], load.replicas
        band = max(1, math.ceil(s.hysteresis * n))
        over = (pressure[role] or 0.0) > 1.0
        mix_moved = bool(growing - {role})
        settled = state is None or _since(state.last_up(role), now) >= s.downscale_cooldown_s or mix_moved
        floor = target
        if state is not None and not mix_moved:
            floor = max(target, state.predicted_most(role) or target)
        if target > n:
            want[role] = target
        elif floor < n - band and not over and settled:
            want[role] = floor
    budget = s.max_total_replicas
    if budget is not None and sum(want.values()) > budget:
        for role in want:
            if want[role] > predicted[role] and (pressure[role] or 0.0) <= 1.0:
                want[role] = max(predicted[role], want[role] - (sum(want.values()) - budget))
    if any(want[r] != loads[r].replicas for r in loads):
        notes.append("predicted " + ", ".join(f"{r} {predicted[r]}" for r in loads))
    return notes


def _fit_budget(want: dict[Role, int], loads: dict[Role, RoleLoad], pressure: dict[Role, float | None],
                state: PlannerState, s: PlannerSettings, now: float,
                predicted: dict[Role, int] | None = None) -> list[str]:
    """Bring ``want`` within max_total_replicas: donors first, then cut growth, lowest pressure first.
    With a prediction a donor keeps its predicted count: reactive growth past the prediction (a
    backlog already queued on the running replicas, which new ones do not take over) must not
    starve the other role of what its demand needs."""
    budget = s.max_total_replicas
    if budget is None or sum(want.values()) <= budget:
        return []
    notes = []
    growing = sorted((r for r in want if want[r] > loads[r].replicas), key=lambda r: -(pressure[r] or 0.0))
    for role in growing:
        other = _other(role)
        if other not in want or want[other] != loads[other].replicas:
            continue
        most = min(sum(want.values()) - budget, max(1, loads[other].replicas // 2))  # half at a time
        if predicted is not None:
            most = min(most, loads[other].replicas - predicted[other])
        give = next((k for k in range(most, 0, -1)
                     if _can_give(other, k, loads[other], pressure[other], state, s, now)), 0)
        if give:
            want[other] -= give
            notes.append(f"{other} gives {give} to {role}")
    by_pressure = sorted(want, key=lambda r: pressure[r] or 0.0)
    for floor in ({r: loads[r].replicas for r in want}, {r: s.bounds(r)[0] for r in want}):
        for role in by_pressure:
            excess = sum(want.values()) - budget
            if excess > 0:
                want[role] -= min(excess, max(0, want[role] - floor[role]))
    return notes


def _pace_handover(want: dict[Role, int], loads: dict[Role, RoleLoad], s: PlannerSettings) -> list[str]:
    """Hold a role that grows by taking the other's replicas (under max_total_replicas) to
    ``handover_starting_share`` of the budget starting at once; the donor keeps what is not taken
    yet. Later decisions move the rest as the new replicas come up."""
    share, budget = s.handover_starting_share, s.max_total_replicas
    if share is None or budget is None or len(loads) < 2:
        return []
    limit = max(1, math.ceil(share * budget))
    notes = []
    for role, load in loads.items():
        other = _other(role)
        grow, give = want[role] - load.replicas, loads[other].replicas - want[other]
        if grow <= 0 or give <= 0:
            continue
        starting = load.replicas - (load.ready_replicas if load.ready_replicas is not None else load.replicas)
        allowed = max(0, limit - starting)
        if grow > allowed:
            held = min(grow - allowed, give)
            want[role] -= held
            want[other] += held
            notes.append(f"{other} keeps {held} until {role}'s starting replicas are up")
    return notes


def _can_give(role: Role, k: int, load: RoleLoad, pressure: float | None, state: PlannerState,
              s: PlannerSettings, now: float) -> bool:
    """Whether ``role`` can lose ``k`` replicas and, with its load spread over the rest, stay under
    donor_headroom; never a role that grew within downscale_cooldown_s (no flapping)."""
    n = load.replicas
    return (pressure is not None and not load.starting and n - k >= max(1, s.bounds(role)[0])
            and _since(state.last_up(role), now) >= s.downscale_cooldown_s
            and pressure * n / (n - k) <= s.donor_headroom)


def _has_slack(role: Role, load: RoleLoad, pressure: float | None, state: PlannerState,
               s: PlannerSettings, now: float) -> bool:
    return pressure is not None and pressure < s.slack and _can_give(role, 1, load, pressure, state, s, now)


def _holds_budget(s: PlannerSettings) -> bool:
    """Whether rule 9 applies: decode holds the GPUs of the budget prefill does not."""
    return s.hold_budget and s.max_total_replicas is not None


def _other(role: Role) -> Role:
    return "decode" if role == "prefill" else "prefill"


def _since(t: float | None, now: float) -> float:
    return math.inf if t is None else now - t


def _clamp(n: int, bounds: tuple[int, int]) -> int:
    return max(bounds[0], min(bounds[1], n))


def _fmt(p: float | None) -> str:
    return "unknown" if p is None else f"{p:.2f}"


# --- Ray Serve adapters --------------------------------------------------------------------------

def plan_application(contexts: dict[DeploymentID, AutoscalingContext]
                     ) -> tuple[dict[DeploymentID, int], dict[DeploymentID, dict[str, Any]]]:
    """Application-level policy: both roles planned together, trading replicas at the budget."""
    roles = {DEPLOYMENTS[c.deployment_name]: c for c in contexts.values() if c.deployment_name in DEPLOYMENTS}
    decode = roles.get("decode")
    if decode is None:
        return {}, {}
    settings = _settings(roles)
    prefill: RoleLoad | None = None
    if "prefill" in roles:
        prefill = role_load(roles["prefill"])
    elif settings.has_prefill:  # not deployed yet: hold it
        prefill = RoleLoad(settings.min_prefill, reported=False)
    obs = Observation(decode=role_load(decode), prefill=prefill, demand=demand(decode), **_latencies(decode))
    state = PlannerState.from_dict(next((c.policy_state.get(STATE_KEY) for c in roles.values()
                                         if c.policy_state.get(STATE_KEY)), None))
    decision = plan(obs, settings, state, _now(decode))
    if decision.reason:
        logger.info("planner: %s", decision.reason)
    saved = {STATE_KEY: dataclasses.asdict(decision.state)}
    return ({c.deployment_id: decision.replicas[r] for r, c in roles.items()},
            {c.deployment_id: dict(saved) for c in roles.values()})


def plan_deployment(ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
    """Deployment-level policy: one role alone, within its fixed share of the budget."""
    role = DEPLOYMENTS.get(ctx.deployment_name)
    if role is None:
        return ctx.target_num_replicas, {}
    settings = _settings({role: ctx})
    share = settings.share(role)
    if settings.max_total_replicas is not None:
        settings = dataclasses.replace(settings, max_total_replicas=share + _other_min(role, settings))
    other = RoleLoad(_other_min(role, settings), reported=False)
    load = role_load(ctx)
    if role == "prefill":
        obs = Observation(decode=other, prefill=load)
    else:
        obs = Observation(decode=load, prefill=other if settings.has_prefill else None, demand=demand(ctx),
                          **_latencies(ctx))
    saved = dict(ctx.policy_state.get(STATE_KEY) or {})
    if not saved.pop("warned", False):
        logger.warning("planner: no application-level policy, so %s scales alone within %d replicas; name "
                       "cluster.router.planner:plan_application in the Serve config's autoscaling_policy to "
                       "move replicas between prefill and decode", role, share)
    decision = plan(obs, settings, PlannerState.from_dict(saved), _now(ctx))
    if decision.reason:
        logger.info("planner (%s alone): %s", role, decision.reason)
    return decision.replicas[role], {STATE_KEY: {**dataclasses.asdict(decision.state), "warned": True}}


def role_load(ctx: AutoscalingContext) -> RoleLoad:
    """A role's load from its replicas' reports, averaged by Ray over the look-back window."""
    metrics = ctx.aggregated_metrics or {}
    waiting = list((metrics.get(WAITING) or {}).values())
    ready = ctx.current_num_replicas
    queued = float(ctx.total_queued_requests or 0.0)  # at handles, not yet on a replica
    return RoleLoad(replicas=ctx.target_num_replicas, ready_replicas=ready, reported=bool(waiting),
                    waiting=_mean(waiting) + queued / max(1, ready),
                    kv_usage=max((metrics.get(KV_USAGE) or {}).values(), default=0.0))


def demand(decode: AutoscalingContext) -> Demand | None:
    """The application's demand from its decode replicas' reports: arrival rates summed (each
    request is decoded by one replica), token means weighted by them. None before any report, or
    while requests arrive but none has completed yet (output length unknown)."""
    metrics = decode.aggregated_metrics or {}
    rates = metrics.get(ARRIVAL_RPS) or {}
    if not rates:
        return None
    total = sum(rates.values())
    if total <= 0:
        return Demand(0.0, 0.0, 0.0)

    def weighted(name: str) -> float:  # over the replicas that have a value (no completion yet: none)
        values = {r: v for r, v in (metrics.get(name) or {}).items() if v > 0 and r in rates}
        weight = sum(rates[r] for r in values)
        return sum(rates[r] * v for r, v in values.items()) / weight if weight > 0 else 0.0
    prompt, output = weighted(PROMPT_TOKENS), weighted(OUTPUT_TOKENS)
    cv2 = sum(rates[r] * (metrics.get(ARRIVAL_CV2) or {}).get(r, 0.0) for r in rates) / total
    return Demand(total, prompt, output, cv2) if output > 0 else None


def _latencies(decode: AutoscalingContext) -> dict[str, float]:
    """The worst decode replica's recent p90s."""
    metrics = decode.aggregated_metrics or {}
    return {field: max((metrics.get(name) or {}).values(), default=0.0)
            for field, name in (("ttft_s", TTFT), ("itl_s", ITL), ("prefill_queue_s", PREFILL_QUEUE))}


def _settings(roles: dict[Role, AutoscalingContext]) -> PlannerSettings:
    """Settings from the policy kwargs that deployment_scaling set; bounds from Ray's (capacity-adjusted) ones."""
    kwargs: dict[str, Any] = {}
    for ctx in roles.values():
        policy = getattr(ctx.config, "policy", None)
        kwargs = dict(getattr(policy, "policy_kwargs", None) or {}) or kwargs
    settings = PlannerSettings.from_kwargs(kwargs)
    for role, ctx in roles.items():
        settings = settings.with_bounds(role, ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas)
    return settings


def _other_min(role: Role, s: PlannerSettings) -> int:
    if role == "decode":
        return s.min_prefill if s.has_prefill else 0
    return s.min_decode


def _now(ctx: AutoscalingContext) -> float:
    return ctx.current_time if ctx.current_time is not None else time.time()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# --- wiring (build_app) ---------------------------------------------------------------------------

def deployment_scaling(config: ClusterConfig, role: Role) -> dict[str, Any]:
    """A role deployment's sizing ``.options``: a fixed ``num_replicas``, or with ``autoscale`` an
    autoscaling config whose deployment-level policy is plan_deployment, whose kwargs carry the
    planner's settings (plan_application reads them too), and whose own delays are off (the
    planner's cooldowns pace it; Ray's per-deployment delays would split a move between roles)."""
    initial = config.prefill_replicas if role == "prefill" else config.decode_replicas
    if not config.autoscale:
        return {"num_replicas": initial}
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    policy = AutoscalingPolicy(policy_function="cluster.router.planner:plan_deployment",
                               policy_kwargs=dataclasses.asdict(PlannerSettings.from_config(config)))
    return {"autoscaling_config": AutoscalingConfig(
        min_replicas=config.min_replicas, max_replicas=config.max_replicas, initial_replicas=initial,
        upscale_delay_s=0.0, downscale_delay_s=0.0, look_back_period_s=LOOK_BACK_S, policy=policy)}
