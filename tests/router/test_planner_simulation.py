"""The cluster simulator (``bench/simulate.py``) that drives the planner at scales these machines
cannot hold: requests are conserved, latencies respect the cost model's floors, disaggregation
keeps decode steps free of prefill chunks, and the planner moves replicas toward the role that
misses its target."""
from __future__ import annotations

import os

import numpy as np
import pytest

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


def test_host_cost_per_sequence_caps_a_decode_replica():
    """With 1 ms of host time per running sequence per step (the serving stack's streaming), a
    decode replica makes at most ~1,000 tokens/s: at twice that demand ITL grows with the batch,
    where the GPU alone would keep it near its floor."""
    reqs = make_requests([Phase(20.0, 8.0, "chat")], seed=4)  # ~3,000 output tokens/s
    gpu_only = Simulation(_costs(), reqs, prefill=1, decode=1, dt=0.01).run()
    host = Costs(prefill_flops_s=2e14, step_overhead_s=0.0005, step_per_seq_s=0.001, startup_s=20.0)
    capped = Simulation(host, reqs, prefill=1, decode=1, dt=0.01).run()
    assert float(reqs["output"].sum()) / 20.0 > 2 * 1000.0  # the demand really is over the cap
    assert capped["completed"] == len(reqs["arrival"])
    assert capped["itl_p50"] > 4 * gpu_only["itl_p50"]
    assert capped["phases"][0]["tpot_p90"] > 0.02  # batches of tens of sequences at ~1 ms each


def test_the_planner_sees_demand_and_first_tokens_as_they_happen():
    """The simulator reports what the router and replicas report: arrival rate and prompt length
    over the window, TTFT at each first token (not at the end of the request)."""
    reqs = make_requests([Phase(40.0, 4.0, "rag")], seed=5)
    sim = Simulation(_costs(), reqs, prefill=2, decode=2, dt=0.02)
    for tick in range(int(30.0 / sim.dt)):
        sim.step(tick * sim.dt)
    obs = sim.observe(30.0)
    assert obs.demand is not None
    assert 2.5 < obs.demand.arrival_rps < 5.5 and 2500 < obs.demand.prompt_tokens < 6500
    assert obs.ttft_s > 0.0 and obs.itl_s > 0.0


def test_a_saturated_prefill_pool_prefills_on_the_decode_replicas():
    """Queue-aware conditional disaggregation: with one prefill replica and long prompts arriving
    faster than it prefills them, requests whose expected wait for the pool passes half the TTFT
    target are prefilled by their decode replica (its steps carry the chunks), so far more meet
    TTFT; with the rule off (None, the old behaviour) none is, and the queue's wait is everyone's."""
    costs = _costs()
    reqs = make_requests([Phase(20.0, 5.0, "rag")], seed=6)
    queued = Simulation(costs, reqs, prefill=1, decode=3, dt=0.01).run()
    local = Simulation(costs, reqs, prefill=1, decode=3, dt=0.01, local_prefill_wait=0.5).run()
    assert queued["local_prefills"] == 0
    assert queued["completed"] == local["completed"] == len(reqs["arrival"])
    assert 0 < local["local_prefills"] < len(reqs["arrival"])  # the pool still prefills its share
    assert local["ttft_p90"] < queued["ttft_p90"] / 2
    assert local["goodput_fraction"] > queued["goodput_fraction"] + 0.2
    # the decode replicas' steps carry prefill chunks now: some tokens miss the ITL target
    assert local["tokens_over_itl_target"] > 0.0 == queued["tokens_over_itl_target"]


def test_local_prefill_chunks_can_be_cut_to_the_itl_target():
    """With ``local_chunk_itl`` a decode replica's local prefill chunks are cut so its steps stay
    within that share of the ITL target: no token misses it, and TTFT still gains."""
    costs = _costs()
    reqs = make_requests([Phase(20.0, 5.0, "rag")], seed=6)
    queued = Simulation(costs, reqs, prefill=1, decode=3, dt=0.01).run()
    cut = Simulation(costs, reqs, prefill=1, decode=3, dt=0.01, local_prefill_wait=0.5, local_chunk_itl=0.8).run()
    assert cut["completed"] == len(reqs["arrival"]) and cut["local_prefills"] > 0
    assert cut["tokens_over_itl_target"] == 0.0
    assert cut["ttft_p90"] < queued["ttft_p90"] / 2


def test_closed_loop_clients_keep_their_concurrency():
    """Closed-loop clients (a benchmark's ``--concurrency``): the first ``concurrency`` requests
    start at 0, each later one starts when an earlier one ends, so at most ``concurrency`` are in
    flight at any time and every request completes; the caller's requests are left as they were."""
    costs = _costs()
    reqs = make_requests([Phase(10.0, 4.0, "chat")], seed=3)
    original = reqs["arrival"].copy()
    sim = Simulation(costs, reqs, prefill=1, decode=1, dt=0.01, concurrency=3)
    out = sim.run()
    n = len(original)
    assert out["completed"] == out["requests"] == n > 10
    assert np.array_equal(reqs["arrival"], original)
    arrival, finished = sim.r["arrival"], sim.finished
    assert (arrival[:3] == 0.0).all() and np.isfinite(arrival).all()
    assert np.isin(np.round(arrival[3:], 6), np.round(finished, 6)).all()  # each starts when one ends
    times = np.linspace(0.0, float(finished.max()), 400)
    in_flight = [int(((arrival <= t) & (finished > t)).sum()) for t in times]
    assert max(in_flight) == 3


def test_textless_tokens_merge_their_gaps_with_the_next_token():
    """ITL is per text chunk: with a share q of tokens bringing no text, q of a token's chunks
    span two steps, the ITL p90 moves to two steps once q / (1 - q) passes a tenth, and the
    per-token TPOT and the p50 stay as they were."""
    import dataclasses
    costs = _costs()
    reqs = make_requests([Phase(10.0, 1.0, "chat")], seed=4)
    plain = Simulation(costs, reqs, prefill=1, decode=1, dt=0.005, concurrency=1).run()
    merged = Simulation(dataclasses.replace(costs, textless_token_share=0.15), reqs, prefill=1, decode=1, dt=0.005,
                        concurrency=1).run()
    assert plain["itl_p90"] < 1.1 * plain["itl_p50"]
    assert merged["itl_p50"] == plain["itl_p50"] and merged["tpot_p50"] == plain["tpot_p50"]
    assert 1.8 * plain["itl_p90"] < merged["itl_p90"] < 2.2 * plain["itl_p90"]


def test_each_requests_own_text_chunks_set_its_gaps():
    """Which tokens stream text is each request's (the row's own streams, not another run's
    share): a request of ``o`` tokens and ``c`` chunks has ``(o - 1) / (c - 1)`` steps a gap. A
    sixteenth of the requests streaming a chunk every two tokens (well under a tenth of the pooled
    gaps doubled) leaves the pooled p90 at one step, a quarter moves it to two; TPOT is the
    tokens', unchanged."""
    from bench.simulate import gap_steps
    assert np.allclose(gap_steps(np.array([32.0, 32.0, 32.0, 1.0]), np.array([32.0, 16.0, 1.0, 1.0])),
                       [1.0, 31 / 15, 31.0, 1.0])
    costs = _costs()
    reqs = make_requests([Phase(10.0, 2.0, "chat")], seed=4)
    n = len(reqs["arrival"])
    plain = Simulation(costs, reqs, prefill=1, decode=1, dt=0.005, concurrency=2).run()
    runs = {}
    for share in (16, 4):
        chunks = reqs["output"].copy()
        chunks[: n // share] = np.ceil(reqs["output"][: n // share] / 2)  # a chunk per two tokens
        runs[share] = Simulation(costs, dict(reqs, chunks=chunks), prefill=1, decode=1, dt=0.005,
                                 concurrency=2).run()
    assert runs[16]["itl_p90"] < 1.2 * plain["itl_p90"] and runs[16]["itl_p99"] > 1.8 * plain["itl_p50"]
    assert runs[4]["itl_p90"] > 1.8 * plain["itl_p90"]
    assert runs[16]["tpot_p50"] == runs[4]["tpot_p50"] == plain["tpot_p50"]


def test_a_measured_gap_spread_scatters_the_simulated_gaps_about_their_step():
    """The one-step gaps of a measured stream (merged and read-together gaps left out) become a
    kernel on the ITL histogram's log bins, median at 0; spreading a histogram keeps its mass and
    moves its p90 by the kernel's p90."""
    from bench.simulate import gap_spread, spread_histogram
    rng = np.random.default_rng(0)
    step = 0.05
    singles = step * np.exp(rng.normal(0.0, 0.1, 2000))
    gaps = np.concatenate([singles, 2 * step * np.ones(150), 0.01 * step * np.ones(50)])
    bins, weights = gap_spread(gaps)
    assert abs(sum(weights) - 1.0) < 1e-9 and min(bins) > -20 and max(bins) < 20  # the 2x / 0.01x left out
    cdf = np.cumsum(weights)
    assert bins[int(np.searchsorted(cdf, 0.5))] == 0
    p90 = bins[int(np.searchsorted(cdf, 0.9))]
    assert abs(10 ** (p90 / 80) - np.exp(1.2816 * 0.1)) < 0.03  # a lognormal's p90
    hist = np.zeros(400)
    hist[200] = 3.0
    spread = spread_histogram(hist, bins, weights)
    assert abs(spread.sum() - 3.0) < 1e-9 and spread[200 + p90] > 0 and spread[:200 + min(bins)].sum() == 0
    assert spread_histogram(hist, (), ()) is hist


def test_a_colocated_replicas_prompt_chunks_keep_its_steps_within_the_chunk_step_target():
    """As the served app's colocated replicas (decode replicas prefilling locally, their chunk
    sizer aiming at a step time): long prompts are cut into chunks so that no step, decode batch
    and host included, outlasts the target; prompts then take longer (TTFT) and the decoding
    requests wait less (ITL tail, TPOT) than with chunks that fill the token budget."""
    costs = _costs()
    reqs = make_requests([Phase(10.0, 2.0, "rag")], seed=4)
    full = Simulation(costs, reqs, prefill=0, decode=1, colocated=True, dt=0.002, concurrency=4).run()
    cut = Simulation(costs, reqs, prefill=0, decode=1, colocated=True, dt=0.002, concurrency=4,
                     chunk_step_s=0.03).run()
    assert cut["completed"] == full["completed"] == cut["requests"]
    assert full["itl_p99"] > 0.1 and cut["itl_p99"] <= 0.03 * 1.05  # (histogram bins: 5% wide at most)
    assert cut["ttft_p50"] > 1.2 * full["ttft_p50"]
    assert cut["tpot_p50"] < full["tpot_p50"]


def test_prefill_steps_pack_the_queue_and_release_first_tokens_at_the_step_end():
    """``prefill_steps``: a prefill replica packs its queue into steps of up to the token budget,
    as the engine schedules them, and every prompt whose last chunk is in a step gets its first
    token when that step ends: four prompts arriving together leave at once (one prompt after
    another, the first would leave after a quarter of the time), and the work is the same."""
    import dataclasses
    costs = dataclasses.replace(_costs(), max_batched_tokens=4096, prefill_overhead_s=0.004)
    n = 4
    reqs = {"arrival": np.zeros(n), "prompt": np.full(n, 1000.0), "output": np.full(n, 8.0),
            "phase": np.zeros(n, dtype=int)}
    one_by_one = Simulation(costs, reqs, prefill=1, decode=1, dt=0.001)
    stepped = Simulation(costs, reqs, prefill=1, decode=1, dt=0.001, prefill_steps=True)
    a, b = one_by_one.run(), stepped.run()
    assert a["completed"] == b["completed"] == n
    first_a, first_b = one_by_one.first_token, stepped.first_token
    assert np.ptp(first_b) < 1e-9  # together, at the step's end
    assert first_a[0] < 0.3 * first_b[0] and abs(first_a[-1] - first_b[-1]) < 0.01 * first_b[-1] + 0.003
    # a bigger queue than the budget: two steps, the second's prompts leave a step later
    reqs8 = {k: np.concatenate([v, v]) for k, v in reqs.items()}
    eight = Simulation(costs, reqs8, prefill=1, decode=1, dt=0.001, prefill_steps=True)
    eight.run()
    assert np.ptp(eight.first_token[:4]) < 1e-9 and np.ptp(eight.first_token[4:]) < 1e-9
    assert eight.first_token[4] > 1.9 * eight.first_token[0] - 0.01


def test_on_one_cpu_machine_a_busy_prefill_replica_slows_the_decode_replicas_host_work_too():
    """Disaggregated replicas sharing one device: a GPU's decode step waits for the prefill's time
    slices in its device work only (the host is its own); on a CPU machine (host work does not
    overlap the compute, the same cores) the host's part slows too."""
    import dataclasses
    base = dataclasses.replace(_costs(), step_overhead_s=0.02, step_per_seq_s=0.0)
    reqs = make_requests([Phase(10.0, 3.0, "rag")], seed=5)
    gpu = Simulation(base, reqs, prefill=1, decode=1, dt=0.005, shared_gpu=True, gpus=1).run()
    cpu = Simulation(dataclasses.replace(base, host_overlaps_gpu=False), reqs, prefill=1, decode=1, dt=0.005,
                     shared_gpu=True, gpus=1).run()
    alone = Simulation(dataclasses.replace(base, host_overlaps_gpu=False), reqs, prefill=1, decode=1, dt=0.005,
                       shared_gpu=False, gpus=2).run()
    assert cpu["completed"] == gpu["completed"] == alone["completed"] == len(reqs["arrival"])
    # a step is host-bound here (20 ms of host work): shared, the GPU's stays near it, the CPU's doubles
    assert gpu["itl_p50"] < 1.2 * 0.02 < 1.6 * 0.02 < cpu["itl_p90"]
    assert cpu["itl_p90"] > 1.5 * alone["itl_p90"]


def test_validation_reports_repeated_runs_against_their_median_and_spread():
    """The same workload served in several runs: the validation reports the measured values,
    their run-to-run spread, the simulated value against their median, and counts only the p50s
    no run was fitted on."""
    from bench.simulate_validation import METRICS, repeats

    def row(values, sim, fitted=None):
        return {"measured": dict.fromkeys(METRICS, 1.0) | values, "simulated": dict.fromkeys(METRICS, 1.0) | sim,
                "fitted_on_this_row": fitted}
    rows = {"a.json:disagg-rate4": row({"itl_p50": 2.0, "ttft_p50": 0.10}, {"itl_p50": 2.6, "ttft_p50": 0.09}),
            "b.json:disagg-rate4": row({"itl_p50": 3.0, "ttft_p50": 0.12}, {"itl_p50": 2.6, "ttft_p50": 0.09},
                                       fitted=["ttft_p50"]),
            "c.json:disagg-rate4": row({"itl_p50": 4.0, "ttft_p50": 0.11}, {"itl_p50": 2.6, "ttft_p50": 0.09}),
            "a.json:colocated-rate4": row({}, {})}  # measured once: no repeat
    out = repeats(rows)
    assert list(out["workloads"]) == ["disagg-rate4"]
    itl = out["workloads"]["disagg-rate4"]["metrics"]["itl_p50"]
    assert itl["measured"] == [2.0, 3.0, 4.0] and itl["median"] == 3.0 and abs(itl["spread"] - 2 / 3) < 1e-12
    assert abs(itl["residual_vs_median"] - (2.6 - 3.0) / 3.0) < 1e-12 and itl["within_measured_range"]
    ttft = out["workloads"]["disagg-rate4"]["metrics"]["ttft_p50"]
    assert ttft["fitted_in_a_run"] and not ttft["within_measured_range"]
    summary = out["predicted_p50_vs_median_of_runs"]
    assert summary["of"] == 2 and summary["within_15pct"] == 2 and summary["within_measured_range"] == 2  # itl, tpot


def test_the_validation_replays_each_serving_runs_own_requests():
    """The committed H200 serving runs' requests, rebuilt from each row's recorded client config
    by bench/serve.py's own seeded draws: the same prompt and output token totals the runs
    recorded, Poisson arrivals at the row's rate from 0."""
    import glob
    import json
    import os

    from bench.simulate import RESULTS
    from bench.simulate_validation import run_requests
    rows = 0
    for path in sorted(glob.glob(os.path.join(RESULTS, "serve-h200-*.json"))):
        with open(path) as f:
            serve = json.load(f)
        for mode in ("disagg", "colocated"):
            for rate, row in serve["modes"][mode]["runs"].items():
                requests = run_requests(row["config"])
                assert len(requests["arrival"]) == row["num_requests"] == len(requests["prompt"])
                assert int(requests["prompt"].sum()) == row["total_prompt_tokens"]
                assert int(requests["output"].sum()) == row["total_output_tokens"]
                gaps = np.diff(requests["arrival"])
                assert requests["arrival"][0] == 0.0 and (gaps > 0).all()
                assert 0.5 / float(rate) < gaps.mean() < 2.0 / float(rate)
                rows += 1
    assert rows >= 12


def test_the_offline_replay_serves_a_served_rows_requests_with_its_clients_and_step_target(tmp_path):
    """``bench/offline_replay.py``: the served row's seeded requests (its recorded client config)
    through the offline engine, the same number in flight and the served colocated replica's
    chunk step target; every request completes with its output length, and the served row is
    set against the replay's medians."""
    import json
    from bench import offline_replay
    from bench.serve import BenchConfig, request_lengths
    config = {"base_url": "", "model": "SmolLM2-135M-Instruct", "num_requests": 5, "rate": None, "concurrency": 2,
              "input_len": 40, "output_len": 3, "input_len_range": 0.5, "output_len_range": 0.0,
              "ttft_target_s": 2.0, "itl_target_s": 0.25, "seed": 3, "label": "colocated-load", "prompt_kind": "ids",
              "token_id_range": [100, 1000], "temperature": 0.0, "ignore_eos": True, "warmup": 1, "timeout_s": 60.0}
    row = {"config": config, "ttft_s": {"p50": 0.5, "p90": 0.9}, "itl_s": {"p50": 0.05, "p90": 0.08},
           "output_token_throughput_tps": 20.0}
    serve_file = tmp_path / "serve.json"
    serve_file.write_text(json.dumps({"runs": {"colocated": {"load": row}}}))
    out = offline_replay.main(["--serve-file", str(serve_file), "--repeats", "1", "--out", str(tmp_path / "r.json")])
    _, outputs = request_lengths(BenchConfig(**dict(config, token_id_range=(100, 1000))))
    run = out["repeats"][0]
    assert run["completed"] == 5 and run["output_tokens"] == sum(outputs[1:]) == 15
    assert out["prefill_step_target_s"] > 0 and out["sized_chunks_per_step"] is True
    assert 0 < run["ttft_p50_s"] <= run["ttft_p90_s"] and run["itl_p50_s"] > 0
    assert out["served_over_offline"]["ttft_p50_s"] == 0.5 / out["median"]["ttft_p50_s"]
    assert json.loads((tmp_path / "r.json").read_text())["benchmark"] == "offline-replay"


def test_cpu_accounting_counts_a_busy_child_and_its_threads():
    """bench/serve_compare.py's CPU breakdown: a child that spins for a while shows up in its
    group with about that many CPU seconds, and this process's threads are summed by name."""
    import subprocess
    import sys
    import time

    from bench.common import cpu_by_group, process_cpu_seconds, process_group, thread_cpu_seconds
    assert process_group("ray::ServeReplica:cluster:DecodeServer") == "decode replica"
    assert process_group("python -m cluster.local_server model=smollm2") == "local server"
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.6: pass\ntime.sleep(30)"])
    try:
        before = process_cpu_seconds(child.pid)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            spent = cpu_by_group(before, process_cpu_seconds(child.pid)).get("other", 0.0)
            if spent >= 0.4:
                break
            time.sleep(0.1)
        assert 0.4 <= spent < 5.0
    finally:
        child.kill()
        child.wait()
    names = thread_cpu_seconds(os.getpid())
    assert names and sum(names.values()) > 0


def test_the_serving_runs_own_step_table_prices_the_cpu_validation(tmp_path):
    """``bench/serve_compare.py`` times the engine's decode steps at the served replica's one
    thread, by batch up to the load's concurrency, on the load's own prompts, and leaves the
    process's thread count as it found it; the CPU validation takes that table (each batch's
    mean of the before and after runs) over any engine file, unless one is named."""
    import argparse

    import torch

    from bench import serve_compare, simulate_validation
    args = argparse.Namespace(model="smollm2", num_requests=12, concurrency=2, input_len=200, output_len=4,
                              ttft_target_s=2.0, itl_target_s=0.25, seed=0)
    threads = torch.get_num_threads()
    steps = serve_compare.replica_steps(args, new_tokens=6)
    assert torch.get_num_threads() == threads
    assert steps["threads"] == 1 and [r["batch"] for r in steps["rows"]] == [1, 2]
    assert all(0 < r["decode_step_ms"] < 5000 for r in steps["rows"])
    # the mixed steps: every batch from 0 (a prompt alone) at both caps, each chunk at its cap
    assert [(r["chunk_cap"], r["batch"]) for r in steps["mixed"]] == [(16, 0), (16, 1), (16, 2),
                                                                       (64, 0), (64, 1), (64, 2)]
    assert all(r["prompt_tokens"] == r["chunk_cap"] and 0 < r["step_ms"] < 5000 for r in steps["mixed"])
    # a prompt alone, whole: the spare prompts left after the mixed steps', at their token counts
    assert 2 <= len(steps["prefill"]) <= serve_compare.PREFILL_PROMPTS
    assert all(r["prompt_tokens"] > 64 and r["step_ms"] > 0 for r in steps["prefill"])

    # a mixed step: 40 ms + 1 ms a prompt token alone, 50 ms + 2 ms a token beside two decoders
    mixed = [{"batch": 0, "chunk_cap": 16, "prompt_tokens": 16, "step_ms": 56.0},
             {"batch": 0, "chunk_cap": 64, "prompt_tokens": 64, "step_ms": 104.0},
             {"batch": 2, "chunk_cap": 16, "prompt_tokens": 16, "step_ms": 82.0},
             {"batch": 2, "chunk_cap": 64, "prompt_tokens": 64, "step_ms": 178.0}]
    after = {"threads": 1, "rows": [{"batch": 1, "decode_step_ms": 30.0}, {"batch": 2, "decode_step_ms": 50.0}],
             "mixed": mixed, "prefill": [{"prompt_tokens": 100, "step_ms": 130.0},
                                         {"prompt_tokens": 300, "step_ms": 330.0}]}
    before = {"threads": 1, "rows": [{"batch": 1, "decode_step_ms": 10.0}, {"batch": 2, "decode_step_ms": 30.0}],
              "mixed": mixed}
    table = simulate_validation.replica_step_table({"replica_steps": {"before": before, "after": after}})
    assert table is not None
    costs = simulate_validation.cpu_costs(table)
    assert costs.step_batches == (1.0, 2.0) and costs.step_seconds == (0.02, 0.04)
    assert "serving run" in costs.sources["engine"]
    assert np.allclose(costs.mixed_base_s, (0.04, 0.05)) and np.allclose(costs.mixed_token_s, (0.001, 0.002))
    # the prefill replica's steps: 30 ms + 1 ms a token, from the whole prompts' line
    assert np.isclose(costs.prefill_overhead_s, 0.03) and np.isclose(costs.prefill_token_s, 0.001)
    # with two replicas of one thread on two cores, no time slicing between them
    assert not costs.own_cores and simulate_validation.cpu_costs(table, cores=2).own_cores
    # a chunk step is priced from the mixed line (not the decode step plus the prefill rate), and
    # the chunk that fits a step target leaves room for the host's time and the line's fixed cost
    assert np.isclose(costs.chunk_step_compute(1.0, 0.02, 10.0, 200.0), 0.045 + 0.0015 * 10)
    assert np.isclose(costs.chunk_tokens(0.1, 2.0, 0.04, 0.01, 200.0), (0.1 - 0.01 - 0.05) / 0.002)
    plain = simulate_validation.cpu_costs({"rows": table["rows"], "_file": "engine"})
    assert np.isclose(plain.chunk_step_compute(1.0, 0.02, 10.0, 200.0), 0.02 + 10 * plain.prefill_token_s)
    assert simulate_validation.replica_step_table({"runs": {}}) is None


def test_a_colocated_replica_can_cut_its_chunks_with_the_engines_own_chunk_sizer():
    """``chunk_sizer``: the colocated replica's prompt chunks come from the engine's ChunkSizer
    (``cluster/engine/scheduler.py``), not from the tokens that fill the step target exactly: a
    prompt alone goes in chunks of the sizer's first cap (256) since a step with no decoding
    request teaches it nothing, so it is prefilled faster than in target-sized chunks; beside
    decoding requests the cap learns its way down to what keeps a step within the target."""
    import dataclasses

    from cluster.engine.scheduler import ChunkSizer
    # a chunk step's fixed part (the host's 20 ms, not overlapped) makes small chunks dear
    costs = dataclasses.replace(_costs(), prefill_flops_s=2e13, step_overhead_s=0.02, host_overlaps_gpu=False)
    alone = {"arrival": np.zeros(1), "prompt": np.full(1, 2000.0), "output": np.full(1, 4.0),
             "phase": np.zeros(1, dtype=int)}
    ideal = Simulation(costs, alone, prefill=0, decode=1, colocated=True, dt=0.001, chunk_step_s=0.05)
    sized = Simulation(costs, alone, prefill=0, decode=1, colocated=True, dt=0.001, chunk_step_s=0.05,
                       chunk_sizer=True)
    ideal.run(), sized.run()
    assert sized.first_token[0] < 0.8 * ideal.first_token[0]
    assert sized.replicas[0].sizer is not None and sized.replicas[0].sizer.cap == 256  # never taught
    # beside decoding requests: the cap converges below the tokens that fill the target
    reqs = make_requests([Phase(6.0, 3.0, "rag")], seed=2)
    sim = Simulation(costs, reqs, prefill=0, decode=1, colocated=True, dt=0.001, concurrency=4,
                     chunk_step_s=0.05, chunk_sizer=True)
    out = sim.run()
    assert out["completed"] == out["requests"]
    sizer = sim.replicas[0].sizer
    assert sizer is not None and ChunkSizer.MIN_TOKENS <= sizer.cap < 256
    fill = costs.chunk_tokens(0.05, 4.0, 0.0, 0.0, 4096.0)  # (its timer sees no host part)
    assert sizer.cap <= fill * 1.05
    # sampled as the served gauge is: the first cap until it learns, then the learned ones
    samples = sim.cap_samples
    assert samples[0][1] == 256 and samples[-1][1] == sizer.cap
    assert all(b[0] - a[0] < 0.5 + 0.0011 for a, b in zip(samples, samples[1:]))
    # or a served replica's sampled cap replayed: 256 until 0.05 s, then 40 tokens a step
    replayed = Simulation(costs, alone, prefill=0, decode=1, colocated=True, dt=0.001, chunk_step_s=0.05,
                          chunk_caps=[[0.05, 40.0]])
    replayed.run()
    assert replayed.replicas[0].sizer is None
    # (its first step, begun before 0.05 s, keeps its 256 tokens: a step's chunk is fixed as it begins)
    assert replayed.first_token[0] > 1.4 * sized.first_token[0]
    assert [c for _, c in replayed.cap_samples[:2]] == [256.0, 40.0]


def _capped_sim(per_step: bool):
    from collections import deque

    n = 24
    reqs = {"arrival": np.zeros(n), "prompt": np.full(n, 300.0), "output": np.full(n, 40.0),
            "phase": np.zeros(n, dtype=int)}
    sim = Simulation(_costs(), reqs, prefill=0, decode=1, colocated=True, dt=0.002, concurrency=8,
                     chunk_step_s=1.0, chunk_sizer=True, chunks_per_step=per_step)
    rep = sim.replicas[0]
    rep.queue, rep.head_done = deque([0, 1, 2]), 100.0
    sim.r = {**reqs, "prompt": np.array([1000.0, 300.0, 300.0] + [300.0] * (n - 3))}
    return sim, rep, reqs


def test_the_cap_bounds_each_prompt_and_only_a_cut_prompt_teaches_the_sizer():
    """With ``sized_chunks_per_step`` off (``Scheduler.chunk_cap``) the cap bounds each prompt's
    chunk, not the step's: a step packs prompts in order up to its budget, and only a step that
    cut a prompt at the cap teaches the sizer (``StepLoop._size_chunks``). So prompts shorter
    than the cap stop its growth."""
    from collections import deque

    sim, rep, reqs = _capped_sim(per_step=False)
    assert sim._capped_chunks(rep, 8192.0, 512.0) == (512.0 + 300.0 + 300.0, True)  # the head cut at 512
    assert sim._capped_chunks(rep, 600.0, 512.0) == (600.0, True)  # the budget ends the step
    # nothing cut (the head's 900 tokens left, then two of 300): nothing learned
    assert sim._capped_chunks(rep, 8192.0, 2000.0) == (1500.0, False)
    rep.queue, rep.head_done, sim.r = deque(), 0.0, reqs
    # far inside the step target: 300-token prompts take the cap from 256 to 512 (one cut), no further
    out = sim.run()
    assert out["completed"] == out["requests"] == 24
    assert rep.sizer is not None and rep.sizer.cap == 512
    assert max(c for _, c in sim.cap_samples) == 512


def test_by_default_the_cap_bounds_the_steps_prompt_tokens_together_as_served():
    """The served default (``sized_chunks_per_step``, ``Scheduler.step_prompt_cap``): the cap
    bounds a step's prompt tokens together, the prompts taking it in arrival order (a second
    prompt waits while the first takes the cap), and a step whose prompt tokens reached the cap
    teaches the sizer; so queued 300-token prompts grow it past any one prompt."""
    from collections import deque

    from cluster.config import SchedulerConfig
    assert SchedulerConfig().sized_chunks_per_step
    sim, rep, reqs = _capped_sim(per_step=True)
    assert Simulation(_costs(), reqs, prefill=0, decode=1, colocated=True).chunks_per_step
    # room: the queued prompt tokens the budget leaves room for as the step begins (1,500 here:
    # the head's 900 left, then 300 and 300)
    assert sim._capped_chunks(rep, 1500.0, 512.0) == (512.0, True)
    assert sim._capped_chunks(rep, 1500.0, 2000.0) == (1500.0, False)
    rep.queue, rep.head_done, sim.r = deque(), 0.0, reqs
    out = sim.run()
    assert out["completed"] == out["requests"] == 24
    assert rep.sizer is not None and max(c for _, c in sim.cap_samples) > 512


def test_a_colocated_steps_chunk_is_what_is_left_as_it_begins_and_teaches_the_sizer_only_then():
    """A colocated engine step's prompt chunk is decided as the step begins, from the tokens then
    left (the queue head's computed part is not counted again), and kept until it ends; only a
    step whose chunk reached the cap teaches the sizer (a prompt's last 100 tokens under a
    256-token cap grow nothing)."""
    from collections import deque

    sim, rep, reqs = _capped_sim(per_step=True)
    rep.queue, rep.head_done, rep.queued_tokens = deque([0]), 900.0, 100.0  # 1000-token head, 900 done
    sim._chunk_step(rep, batch=4.0, gpu=0.01, host=0.0, now=0.0)
    assert rep.chunk == 100.0 and rep.chunk_left == 1.0 and rep.sizer is not None and rep.sizer.cap == 256
    rep.head_done, rep.queued_tokens = 0.0, 1000.0  # the whole prompt left: the cap bounds the step
    sim._chunk_step(rep, batch=4.0, gpu=0.01, host=0.0, now=0.0)
    assert rep.chunk == 256.0 and rep.sizer.cap > 256  # fast, far inside its 1 s target: it grows
    # the step's chunk stays as it began while the tick's time runs through it
    cap = rep.sizer.cap
    before = rep.queued_tokens
    mean_step = sim._chunk_steps(rep, 0.0, 4.0, 0.01, 0.0, 0.01)
    assert rep.chunk == 256.0 and 0.0 < rep.chunk_left < 1.0 and rep.sizer.cap == cap
    assert mean_step > 0.01 and 0.0 < before - rep.queued_tokens < 256.0


def test_a_replica_that_served_an_earlier_run_starts_from_the_cap_it_learned():
    """A deployment serves its rate runs in turn: the validation starts each run's sizer from the
    served cap's first sample (``starting_cap``), not from the engine's first 256."""
    from bench.simulate_validation import starting_cap
    row = {"server_metrics": {"series": {"cluster:prefill_chunk_cap{decode}": [[0.5, 4096.0], [1.0, 4096.0]]}}}
    assert starting_cap(row) == 4096 and starting_cap({}) is None
    sim, rep, reqs = _capped_sim(per_step=True)
    later = Simulation(_costs(), reqs, prefill=0, decode=1, colocated=True, chunk_step_s=1.0, chunk_sizer=True,
                       chunk_sizer_cap=1024)
    later.replicas[0].queue.append(0)
    later.replicas[0].queued_tokens = 300.0
    later._chunk_step(later.replicas[0], batch=0.0, gpu=0.0, host=0.0, now=0.0)
    assert later.replicas[0].sizer is not None and later.replicas[0].sizer.cap == 1024


def test_the_cpu_validation_compares_the_learned_chunk_cap_with_the_served_one():
    """The served cap's learned mean counts from its first sample off the sizer's first cap;
    a run that never learned (no step beside decoding requests) has none."""
    from bench.simulate_validation import SIZER_FIRST_CAP, learned_cap_mean, served_caps
    assert SIZER_FIRST_CAP == 256
    assert learned_cap_mean([[0.5, 256.0], [1.0, 256.0], [1.5, 40.0], [2.0, 20.0]]) == 30.0
    assert learned_cap_mean([[0.5, 256.0], [1.0, 512.0], [1.5, 1024.0]]) == 768.0  # (a GPU's: it grows)
    assert learned_cap_mean([[0.5, 256.0], [1.0, 256.0]]) is None and learned_cap_mean([]) is None
    row = {"server_metrics": {"series": {"cluster:prefill_chunk_cap{decode}": [[0.5, 30.0]]}}}
    assert served_caps(row) == [[0.5, 30.0]] and served_caps({}) is None


def test_the_validation_splits_each_ttft_as_the_served_requests_accounted_for_it():
    """``TTFT_PARTS``: the served requests' own timings (``server_timings``) give each TTFT's queue,
    prompt compute and rest (medians): a prefill replica's compute as it reported it and the queue
    as the decode replica saw it (its TTFT less the compute, transfer and first decode step), a
    decode replica's compute as its own TTFT less its queue; a simulation gives the same parts
    from its requests' times, which add up to its TTFTs."""
    from bench.simulate_validation import TTFT_PARTS, measured_ttft_parts, simulated_ttft_parts
    remote = {"queue": 0.01, "prefill_queue": 0.01, "prefill_compute": 0.2, "transfer": 0.02, "first_decode": 0.01,
              "worker_ttft": 0.25, "prepare": 0.004, "ttft": 0.3, "e2e": 1.0}
    # the decode replica's TTFT less the compute, the transfer and the first decode: its queue
    rows = [{"ttft_s": 0.35, "error": None, "server_timings": dict(remote, prefill_compute=c, worker_ttft=w)}
            for c, w in ((0.2, 0.25), (0.1, 0.25), (0.3, 0.4))]  # queues 0.02, 0.12, 0.07
    rows.append({"ttft_s": None, "error": "HTTP 503", "server_timings": None})  # failed: not counted
    parts = measured_ttft_parts({"requests": rows})
    assert parts == pytest.approx({"queue": 0.07, "prefill_compute": 0.2, "rest": 0.13})
    local = [{"ttft_s": 0.5, "error": None, "server_timings": {"queue": 0.1, "worker_ttft": 0.4, "ttft": 0.45}}]
    assert measured_ttft_parts({"requests": local}) == pytest.approx({"queue": 0.1, "prefill_compute": 0.3,
                                                                      "rest": 0.1})
    assert measured_ttft_parts({"requests": [{"ttft_s": 0.5, "error": None}]}) is None  # asked for none
    costs = _costs()
    reqs = make_requests([Phase(10.0, 4.0, "chat")], seed=3)
    sim = Simulation(costs, reqs, prefill=1, decode=1, dt=0.005, prefill_steps=True)
    out = sim.run()
    got = simulated_ttft_parts(sim)
    assert set(got) == set(TTFT_PARTS) and all(v >= 0 for v in got.values())
    ttft = sim.first_token - reqs["arrival"]
    split = (sim.prefill_start - reqs["arrival"]) + (sim.prefill_done - sim.prefill_start) + (
        sim.first_token - sim.prefill_done)
    np.testing.assert_allclose(split, ttft)
    assert got["prefill_compute"] > 0 and got["rest"] >= costs.first_token_delay(0.0)
    assert out["ttft_p50"] == pytest.approx(float(np.median(ttft)))


def test_the_serving_benchmark_samples_what_the_server_says_of_itself():
    """``bench/serve_compare.py``'s ``with_metrics``: while a run goes it samples /metrics (the
    decode replica's learned chunk cap, by role, over time) and records the TTFT breakdown's
    increase over the run; a server that does not answer leaves empty series, not a failure."""
    import http.server
    import threading
    import time

    from bench import serve_compare
    hits = [0]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            hits[0] += 1
            n = hits[0]
            body = ("# TYPE cluster:prefill_chunk_cap gauge\n"
                    f'cluster:prefill_chunk_cap{{model_name="m",role="decode",replica="a"}} {256 - n}\n'
                    "# TYPE cluster:ttft_prefill_queue_seconds histogram\n"
                    f'cluster:ttft_prefill_queue_seconds_bucket{{model_name="m",le="+Inf"}} {n}\n'
                    f'cluster:ttft_prefill_queue_seconds_sum{{model_name="m"}} {0.5 * n}\n'
                    f'cluster:ttft_prefill_queue_seconds_count{{model_name="m"}} {n}\n').encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = serve_compare.with_metrics(url, lambda: (time.sleep(0.6), {"x": 1})[1], period_s=0.1)
    finally:
        server.shutdown()
    assert out["x"] == 1
    series = out["server_metrics"]["series"]["cluster:prefill_chunk_cap{decode}"]
    assert len(series) >= 3 and all(b[1] < a[1] for a, b in zip(series, series[1:]))
    assert all(b[0] > a[0] for a, b in zip(series, series[1:]))
    scrapes = hits[0]  # the sums grew by 0.5 a scrape between the first and the last
    increase = out["server_metrics"]["increase"]
    assert increase["cluster:ttft_prefill_queue_seconds_count"] == scrapes - 1
    assert np.isclose(increase["cluster:ttft_prefill_queue_seconds_sum"], 0.5 * (scrapes - 1))
    gone = serve_compare.with_metrics("http://127.0.0.1:9", lambda: {}, period_s=0.05)
    assert gone["server_metrics"]["series"] == {} and gone["server_metrics"]["increase"] == {}


def test_a_gpu_serving_run_is_validated_from_its_own_step_table(tmp_path):
    """``bench/simulate_validation.py --gpu-serve-file``: a GPU serving run that timed its own
    steps (``bench/serve_gpu.py``) is priced from that table (decode by batch, the mixed lines,
    the whole prompts' line; the host overlapping the device; the run's KV pool and budget), its
    rate runs replayed with their own requests at their send times, four host constants fitted
    on it and every other number reported as a prediction."""
    import argparse
    import json

    from bench import simulate_validation as sv
    with open(os.path.join(sv.RESULTS, "serve-h100-2026-12-07-steps-synced.json")) as f:
        serve = json.load(f)
    for mode in serve["modes"].values():  # a few requests a run keep the test short
        for run in mode["runs"].values():
            run["requests"] = run["requests"][:8]
    costs = sv.own_gpu_costs(serve)
    assert costs.host_overlaps_gpu and costs.max_batched_tokens == 8192 and costs.max_num_seqs == 128
    assert costs.step_batches == (1.0, 2.0, 4.0, 8.0, 16.0, 32.0) and 0.001 < costs.step_seconds[0] < 0.003
    assert costs.mixed_batches[0] == 0.0 and all(t > 0 for t in costs.mixed_token_s)
    assert np.isclose(costs.kv_tokens * costs.kv_bytes_per_token, serve["workload"]["kv_bytes"])
    row = serve["modes"]["disagg"]["runs"]["4.0"]
    requests = sv.open_loop_requests(row)
    assert np.allclose(requests["arrival"], [r["start_s"] for r in row["requests"]])
    assert (np.diff(requests["arrival"]) >= 0).all() and requests["arrival"][-1] > 0.5
    out = sv.simulate_own_gpu(costs, serve, "colocated", 8.0, "sizer")
    assert set(sv.METRICS) <= set(out) and 0 < out["itl_p50"] < 0.05 and 0 < out["ttft_p50"] < 1.0
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(serve))
    args = argparse.Namespace(gpu_serve_file=str(path), chunks="sizer", rounds=1, fit_iters=3)
    result = sv.validate_own_gpu(args)
    assert len(result["rows"]) == 4 and result["predicted_abs_residual"]["of"] == 16
    assert set(result["fitted"]) == {"step_overhead_s", "step_per_seq_s", "ttft_fixed_s", "transfer_fixed_s"}
    assert result["rows"]["serve.json:disagg-rate4"]["fitted_on_this_row"] == ["itl_p50", "ttft_p50"]
    bare = dict(serve, replica_steps={})
    with pytest.raises(ValueError, match="replica_steps"):
        sv.own_gpu_costs(bare)
