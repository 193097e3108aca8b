"""Shared helpers for benchmark scripts: environment facts recorded next to every result, and
robust statistics."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from typing import Any


def environment() -> dict[str, Any]:
    import torch
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # PD_BENCH_COMMIT: the commit a copied tree was made from, where the copy's git is stale
        "commit": os.environ.get("PD_BENCH_COMMIT") or _git("rev-parse", "HEAD"),
        # dirty: a tracked file differs from the commit (a run's own new outputs, untracked, do not count)
        "dirty": False if os.environ.get("PD_BENCH_COMMIT") else bool(_git("status", "--porcelain",
                                                                           "--untracked-files=no")),
        # the project's switches set for this run (PD_*: opt-in or opt-out fast paths), so an A/B
        # result says which side it measured
        "pd_switches": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith("PD_") and k != "PD_BENCH_COMMIT"},
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    else:
        info["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return info


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


class GraphsOffError(SystemExit):
    """A benchmark of CUDA-graph rows whose engine decodes eagerly: its rows would be eager
    numbers under a graphs label, so the script writes no result (and exits non-zero)."""


def require_graphs(engine: Any, what: str) -> str:
    """The engine's CUDA graph status (``GraphStatus.describe()``), for the result's JSON; raises
    GraphsOffError where graphs fell back (capture or self-check failed, model unsupported)."""
    status = engine.runner.graph_status
    if not status.captured:
        raise GraphsOffError(f"{what}: decode CUDA graphs are off ({status.reason}); refusing to write "
                             "a result labelled as graphs")
    return status.describe()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write a benchmark's JSON (creating its folder) and say where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


def graph_seconds_per_call(call: Any, calls: int, replays: int = 20, skip: int = 0) -> float:
    """Seconds per call of ``call(i)`` for ``i < calls``, run as the engine runs kernels: warmed up
    eagerly on a side stream (compiles, autotunes), captured into one CUDA graph of the ``calls``
    calls, replayed once, then timed over ``replays`` replays (median after the first ``skip``)."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del graph
    return median(times[skip:]) / calls


#: Process names, as Ray titles them, grouped for CPU breakdowns (bench/idle_cpu.py,
#: bench/serve_compare.py).
PROCESS_GROUPS = (("ServeController", "serve controller"), ("ProxyActor", "serve proxy"), ("gcs_server", "gcs"),
                  ("raylet", "raylet"), ("Dashboard", "dashboard"), ("dashboard", "dashboard"),
                  ("Ingress", "ingress replica"), ("DecodeServer", "decode replica"),
                  ("PrefillServer", "prefill replica"), ("ClusterState", "state replica"),
                  ("serve run", "serve run (CLI)"), ("cluster.local_server", "local server"))


def process_group(cmdline: str) -> str:
    for needle, name in PROCESS_GROUPS:
        if needle in cmdline:
            return name
    return "other"


def process_cpu_seconds(root_pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of a process and its descendants (Ray's processes are
    children of the ``serve run`` CLI that starts the local instance), by pid: (group, seconds)."""
    import psutil
    seconds: dict[int, tuple[str, float]] = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return seconds
    for p in procs:
        try:
            t = p.cpu_times()
            seconds[p.pid] = (process_group(" ".join(p.cmdline())), t.user + t.system)
        except psutil.Error:
            pass
    return seconds


def cpu_by_group(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each group spent between two ``process_cpu_seconds`` snapshots."""
    out: dict[str, float] = {}
    for pid, (group, t) in after.items():
        out[group] = out.get(group, 0.0) + t - before.get(pid, (group, 0.0))[1]
    return out


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process's threads, summed by thread name (``/proc``'s ``comm``:
    the engine's step thread, the event loop, Ray's core-worker threads, torch's pool)."""
    import psutil
    out: dict[str, float] = {}
    try:
        threads = psutil.Process(pid).threads()
    except psutil.Error:
        return out
    for t in threads:
        try:
            with open(f"/proc/{pid}/task/{t.id}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return out
