"""Disaggregated against colocated serving on one machine, with the cost of Ray measured too.

The offline engine and three deployments of the same model, with the same workload:
  offline     ``LLM.generate`` on the load run's prompts, at most ``--concurrency`` in flight
              (``max_num_seqs``): the engine with no server at all (its output tok/s only)
  local       the OpenAI server over one in-process engine (no Ray): the latency anchor
  colocated   the Ray Serve application with prefill_replicas=0 (decode prefills everything)
  disagg      the Ray Serve application, 1 prefill + 1 decode replica, KV over ``kv_transfer``
Each runs a latency probe (one request at a time: TTFT with no queueing) and a load run
(``--concurrency`` requests in flight). TTFT added by Ray = colocated - local (probe medians);
TTFT added by disaggregation = disagg - colocated (probe medians); plus throughput and goodput,
and each deployment's load-run output tok/s over the offline engine's (what serving costs).
Before and after the deployments it times the engine's steps at the served replica's one thread
(``replica_steps``: decode-only by batch, a prompt chunk beside decoding requests, a prompt whole
alone): the simulator's validation prices its steps from them. During each run it samples what
the server says of itself (``server_metrics``: the decode replica's learned prompt-chunk cap and
its queue over time, the TTFT breakdown's increase), which the validation checks its model against.

    python bench/serve_compare.py --out bench/results/serve-cpu-<date>.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import cpu_by_group, environment, process_cpu_seconds, thread_cpu_seconds  # noqa: E402
from bench.serve import BenchConfig, build_prompts, plot_results, run_benchmark  # noqa: E402

try:
    import httpx
except ImportError:
    import httpx2 as httpx  # type: ignore[no-redef]


def wait_healthy(url: str, proc: subprocess.Popen[str], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def first_completion(url: str, proc: subprocess.Popen[str], timeout: float = 600) -> str:
    """The served model's id, once a one-token completion through the whole path answers 200
    (``/health`` may answer before every replica has loaded its engine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            reply = httpx.post(f"{url}/v1/completions", timeout=60,
                               json={"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0})
            if reply.status_code == 200:
                return model
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def start(kind: str, model: str, port: int, backend: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    settings = [f"model={model}", f"port={port}"]
    if kind == "local":
        cmd = [sys.executable, "-m", "cluster.local_server", *settings, "--port", str(port)]
    else:
        extra = ["prefill_replicas=0"] if kind == "colocated" else [f"kv_transfer={backend}"]
        cmd = ["serve", "run", "cluster.app", *settings, *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)


def stop(proc: subprocess.Popen[str]) -> None:
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def with_cpu(root_pid: int, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``'s result with the CPU seconds every process spent during it (``cpu``): the
    server's processes (``root_pid`` and its descendants; this process may be their root, as
    where Ray runs in it) by group, the load generator (this process), the engine replica's threads
    by name, and the share of the machine's cores each group used (seconds / wall / cores)."""
    me = psutil.Process()

    def servers() -> dict[int, tuple[str, float]]:  # the load generator's own process counts apart
        return {pid: v for pid, v in process_cpu_seconds(root_pid).items() if pid != me.pid}
    before, client_before = servers(), sum(me.cpu_times()[:2])
    engine_pids = [pid for pid, (group, _) in before.items() if group in ("decode replica", "local server")]
    threads_before = {pid: thread_cpu_seconds(pid) for pid in engine_pids}
    began = time.perf_counter()
    result = run()
    wall = time.perf_counter() - began
    groups = cpu_by_group(before, servers())
    groups["load generator"] = sum(me.cpu_times()[:2]) - client_before
    threads: dict[str, float] = {}
    for pid, was in threads_before.items():
        for name, t in thread_cpu_seconds(pid).items():
            threads[name] = threads.get(name, 0.0) + t - was.get(name, 0.0)
    cores = os.cpu_count() or 1
    result["cpu"] = {"wall_s": wall, "cores": cores, "seconds": groups,
                     "share_of_cores": {g: t / wall / cores for g, t in groups.items()},
                     "engine_replica_threads_s": dict(sorted(threads.items(), key=lambda kv: -kv[1])),
                     "note": "the engine replica is the decode replica (colocated / disagg) or the local server"}
    return result


#: Gauges sampled over a run (the replicas report every 0.5 s), by role.
SAMPLED_GAUGES = ("cluster:prefill_chunk_cap", "cluster:num_requests_running", "cluster:num_requests_waiting",
                  "cluster:slowest_step_seconds")
#: What held the replicas' steps besides their work (cluster/engine/stalls.py), by role: steps over
#: ``slow_step_s``, Triton compilations inside steps and their seconds, garbage collection seconds.
STALL_COUNTERS = ("cluster:slow_steps_total", "cluster:step_kernel_compiles_total",
                  "cluster:step_kernel_compile_seconds_total", "cluster:step_gc_seconds_total")


def metric_values(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text: each sample's value by name and then by its ``role`` label ("" if it has
    none; values of one name and role summed over replicas)."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            role = sample.labels.get("role", "")
            by_role = out.setdefault(sample.name, {})
            by_role[role] = by_role.get(role, 0.0) + sample.value
    return out


def scrape(url: str) -> dict[str, dict[str, float]]:
    """The server's /metrics as ``metric_values``; empty if it does not answer."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except Exception:  # noqa: BLE001 - a missed scrape is a gap in the series, not a failed run
        return {}
    return metric_values(text)


def with_metrics(url: str, run: Callable[[], dict[str, Any]], period_s: float = 0.5) -> dict[str, Any]:
    """``run()``'s result with what the server said of itself during it (``server_metrics``): the
    sampled gauges over time (the decode replica's learned prompt-chunk cap and the replicas'
    slowest step so far among them) and the increase of the TTFT breakdown (``cluster:ttft_*_seconds``
    and the queue time: sum and count) and of the steps slower than ``slow_step_s``, so
    a validation can check its model of the replicas against theirs, not only the client's view;
    ``stalls``: the increase of ``STALL_COUNTERS`` by role (what held steps: compilations, garbage
    collection)."""
    series: dict[str, list[list[float]]] = {}
    stop = threading.Event()
    began = time.perf_counter()

    def sample() -> None:
        while not stop.wait(period_s):
            now = round(time.perf_counter() - began, 3)
            for name, by_role in scrape(url).items():
                if name in SAMPLED_GAUGES:
                    for role, value in by_role.items():
                        series.setdefault(f"{name}{{{role}}}" if role else name, []).append([now, value])

    before = scrape(url)
    sampler = threading.Thread(target=sample, name="metrics-sampler", daemon=True)
    sampler.start()
    try:
        result = run()
    finally:
        stop.set()
        sampler.join(timeout=10)
    after = scrape(url)
    increase = {name: sum(after[name].values()) - sum(before.get(name, {}).values())
                for name in after if (name.startswith(("cluster:ttft_", "cluster:request_queue_time"))
                                      and name.endswith(("_sum", "_count"))) or name == "cluster:slow_steps_total"}
    stalls = {f"{name}{{{role}}}" if role else name: value - before.get(name, {}).get(role, 0.0)
              for name in STALL_COUNTERS for role, value in after.get(name, {}).items()}
    result["server_metrics"] = {"period_s": period_s, "series": series, "increase": increase, "stalls": stalls,
                                "note": "series: [seconds since the run began, value]; increase: over the run"}
    return result


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    """The workload fields every run shares: the same seed gives the same prompts and output lengths."""
    return dict(input_len=args.input_len, output_len=args.output_len, input_len_range=0.5,
                ttft_target_s=args.ttft_target_s, itl_target_s=args.itl_target_s, seed=args.seed, warmup=2,
                server_timings=True)


def run_one(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    port = args.port
    url = f"http://127.0.0.1:{port}"
    began = time.perf_counter()
    proc = start(kind, args.model, port, args.kv_transfer)
    try:
        wait_healthy(url, proc)
        healthy_s = time.perf_counter() - began
        model = first_completion(url, proc)
        startup = {"healthy_s": healthy_s, "first_token_s": time.perf_counter() - began}
        print(f"{kind}: /health after {healthy_s:.1f}s, first completion after {startup['first_token_s']:.1f}s")
        common = dict(base_url=url, model=model, **_workload(args))
        probe = with_metrics(url, lambda: with_cpu(proc.pid, lambda: run_benchmark(
            BenchConfig(**common, num_requests=args.probe_requests, concurrency=1, label=f"{kind}-probe"))))
        load = with_metrics(url, lambda: with_cpu(proc.pid, lambda: run_benchmark(
            BenchConfig(**common, num_requests=args.num_requests, concurrency=args.concurrency,
                        label=f"{kind}-load"))))
        probe.pop("requests", None)  # the load runs keep theirs, for the plot
        print(f"{kind}: probe TTFT p50 {probe['ttft_s']['p50']:.3f}s, load {load['output_token_throughput_tps']:.1f} tok/s")
        return {"startup": startup, "probe": probe, "load": load}
    finally:
        stop(proc)
        time.sleep(3)


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    """The load run's requests (same seed: same prompts and output lengths) through the offline
    engine, ``--concurrency`` at a time, after the same two warm-up requests."""
    from cluster import LLM, SamplingParams
    config = BenchConfig(base_url="", model=args.model, num_requests=args.num_requests,
                         concurrency=args.concurrency, **_workload(args))
    prompts = build_prompts(config)
    warmup, timed = prompts[:config.warmup], prompts[config.warmup:]
    llm = LLM(args.model, max_num_seqs=args.concurrency)

    def params(out_len: int) -> Any:
        return SamplingParams(max_tokens=out_len, temperature=config.temperature, ignore_eos=True)
    llm.generate([p for p, _, _ in warmup], [params(n) for _, _, n in warmup])
    start = time.perf_counter()
    outputs = llm.generate([p for p, _, _ in timed], [params(n) for _, _, n in timed])
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"offline: {tokens / wall:.1f} output tok/s")
    return {"output_token_throughput_tps": tokens / wall, "output_tokens": tokens, "wall_s": wall,
            "max_num_seqs": args.concurrency}


#: the prompt chunk caps the mixed steps are timed at (``replica_steps``)
MIXED_CHUNK_CAPS = (16, 64)
#: how many of the workload's prompts the prefill steps are timed on
PREFILL_PROMPTS = 6


def replica_steps(args: argparse.Namespace, threads: int = 1, new_tokens: int = 32) -> dict[str, Any]:
    """The engine's step times at the served replica's thread count (Ray starts a ``num_cpus=0``
    replica with ``OMP_NUM_THREADS=1``, so it computes on one core): decode-only steps by batch
    (1, 2, 4 ... ``--concurrency``), steps carrying a prompt chunk beside 0 .. ``--concurrency``
    decoding requests at each of ``MIXED_CHUNK_CAPS``, and ``PREFILL_PROMPTS`` prompts whole, alone
    (``bench.engine.step_table``). Measured here, in the same run as the deployments, the simulator's
    validation (``bench/simulate_validation.py --cpu``) prices steps on the machine the served runs
    saw; the load run's own prompts, so the contexts are theirs."""
    import torch

    from bench.engine import step_table
    from cluster import LLM
    config = BenchConfig(base_url="", model=args.model, num_requests=args.num_requests,
                         concurrency=args.concurrency, **_workload(args))
    prompts = [p for p, _, _ in build_prompts(config)[config.warmup:]]
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < args.concurrency] + [args.concurrency]
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        table = step_table(lambda **settings: LLM(args.model, **settings), prompts, batches, MIXED_CHUNK_CAPS,
                           PREFILL_PROMPTS, new_tokens)
    finally:
        torch.set_num_threads(was)
    return {"threads": threads, **table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--kv-transfer", default="ipc")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--probe-requests", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--ttft-target-s", type=float, default=2.0)
    parser.add_argument("--itl-target-s", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=f"bench/results/serve-cpu-{datetime.date.today()}.json")
    parser.add_argument("--plot", help="PNG of the load runs' latency CDFs and percentiles (default: next to --out)")
    parser.add_argument("--modes", default="local,colocated,disagg",
                        help="comma-separated deployments to run (the summary needs all three)")
    args = parser.parse_args()
    offline = run_offline(args)
    steps_before = replica_steps(args)
    runs = {kind: run_one(kind, args) for kind in args.modes.split(",")}
    steps_after = replica_steps(args)
    full = set(runs) == {"local", "colocated", "disagg"}
    summary = compare(runs, offline) if full else None
    result: dict[str, Any] = {"benchmark": "serve-disagg-vs-colocated", "model": args.model,
                              "kv_transfer": args.kv_transfer, "command": " ".join(sys.argv),
                              "environment": environment(), **({"summary": summary} if full else {}),
                              "offline": offline, "runs": runs,
                              "replica_steps": {"before": steps_before, "after": steps_after}}
    if full:
        result["note"] = ("one machine: prefill and decode replicas share its CPU cores, so disaggregation here "
                          "measures its overheads (transfer, extra hops), not the interference it removes on GPUs")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    if not full:
        print(json.dumps({k: v["load"].get("cpu") for k, v in runs.items()}, indent=2))
        return
    plot_results([runs[k]["load"] for k in runs], args.plot or os.path.splitext(args.out)[0] + ".png")
    print(json.dumps(summary, indent=2))


def compare(runs: dict[str, Any], offline: dict[str, Any]) -> dict[str, Any]:
    """The three deployments against each other and the offline engine."""
    p50 = {k: v["probe"]["ttft_s"]["p50"] for k, v in runs.items()}
    return {
        "ttft_p50_probe_s": p50,
        "ttft_added_by_ray_s": p50["colocated"] - p50["local"],
        "ttft_added_by_disaggregation_s": p50["disagg"] - p50["colocated"],
        "load_output_tok_s": {k: v["load"]["output_token_throughput_tps"] for k, v in runs.items()},
        "offline_output_tok_s": offline["output_token_throughput_tps"],
        "load_output_over_offline": {k: v["load"]["output_token_throughput_tps"] / offline["output_token_throughput_tps"]
                                     for k, v in runs.items()},
        "load_goodput_rps": {k: v["load"]["goodput_rps"] for k, v in runs.items()},
        "load_ttft_p50_s": {k: v["load"]["ttft_s"]["p50"] for k, v in runs.items()},
        "load_itl_p50_s": {k: v["load"]["itl_s"]["p50"] for k, v in runs.items()},
        # from starting the server (``serve run cluster.app`` for colocated / disagg) to /health
        # answering and to its first one-token completion
        "startup_s": {k: v["startup"] for k, v in runs.items()},
    }

if __name__ == "__main__":
    main()
