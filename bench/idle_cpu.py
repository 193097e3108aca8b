"""Idle CPU of the service: ``serve run cluster.app`` (the README's run command, the embedded
default model, disaggregated) with no request in flight, against the anchor of a bare Ray Serve
application of the same shape (four do-nothing deployments: an HTTP ingress calling a decode
deployment calling a prefill one, and a state actor) on the same machine in the same run. The
difference is what this project adds to Ray Serve's own idle cost.

Each side: start, answer one request (every path warm), wait ``--settle`` seconds, then sum the
CPU seconds of every process over ``--windows`` windows of ``--window`` seconds; medians.

    python bench/idle_cpu.py --out bench/results/idle-cpu-<date>.json
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, write_result  # noqa: E402

try:
    import httpx
except ImportError:
    import httpx2 as httpx  # type: ignore[no-redef]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = "http://127.0.0.1:8000"
#: Process names, as Ray titles them, grouped for the breakdown.
GROUPS = (("ServeController", "serve controller"), ("ProxyActor", "serve proxy"), ("gcs_server", "gcs"),
          ("raylet", "raylet"), ("Dashboard", "dashboard"), ("dashboard", "dashboard"),
          ("Ingress", "ingress replica"), ("DecodeServer", "decode replica"),
          ("PrefillServer", "prefill replica"), ("ClusterState", "state replica"),
          ("serve run", "serve run (CLI)"))

BARE_APP = '''
from ray import serve

OPTIONS = {"ray_actor_options": {"num_cpus": 0}}


@serve.deployment(name="ClusterState", **OPTIONS)
class ClusterState:
    def snapshot(self):
        return []


@serve.deployment(name="PrefillServer", **OPTIONS)
class PrefillServer:
    async def prefill(self, request):
        return request


@serve.deployment(name="DecodeServer", **OPTIONS)
class DecodeServer:
    def __init__(self, prefill, state):
        self.prefill, self.state = prefill, state

    async def generate(self, request):
        return await self.prefill.prefill.remote(request)


@serve.deployment(name="Ingress", **OPTIONS)
class Ingress:
    def __init__(self, decode):
        self.decode = decode

    async def __call__(self, request):
        return await self.decode.generate.remote("ok")


state = ClusterState.bind()
app = Ingress.bind(DecodeServer.bind(PrefillServer.bind(), state))
'''


def group_of(cmdline: str) -> str:
    for needle, name in GROUPS:
        if needle in cmdline:
            return name
    return "other"


def measure(import_path: str, cwd: str, probe: tuple[str, str, dict[str, Any] | None], args: Any) -> dict[str, Any]:
    import psutil
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)  # a fresh local Ray instance, as on an operator's machine
    serve_cli = shutil.which("serve") or os.path.join(os.path.dirname(sys.executable), "serve")
    log = open(os.path.join(args.log_dir, f"idle-{import_path.replace(':', '_')}.log"), "w")
    start = time.monotonic()
    proc = subprocess.Popen([serve_cli, "run", import_path], env=env, cwd=cwd, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        method, path, body = probe
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve run {import_path} exited with {proc.returncode}")
            if time.monotonic() - start > 300:
                raise RuntimeError(f"serve run {import_path} not ready in 300 s")
            try:
                r = httpx.request(method, BASE + path, json=body, timeout=60)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        ready_s = time.monotonic() - start
        time.sleep(args.settle)
        root = psutil.Process(proc.pid)

        def cpu_seconds() -> dict[int, tuple[str, float]]:
            # Ray's processes are children of the CLI (it starts the local instance)
            seconds = {}
            for p in [root, *root.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                    seconds[p.pid] = (group_of(" ".join(p.cmdline())), t.user + t.system)
                except psutil.Error:
                    pass
            return seconds

        windows = []
        for _ in range(args.windows):
            before = cpu_seconds()
            time.sleep(args.window)
            after = cpu_seconds()
            by_group: dict[str, float] = {}
            for pid, (group, t) in after.items():
                by_group[group] = by_group.get(group, 0.0) + (t - before.get(pid, (group, 0.0))[1]) / args.window
            windows.append(by_group)
        totals = [sum(w.values()) for w in windows]
        groups = sorted({g for w in windows for g in w})
        return {"import_path": import_path, "ready_s": round(ready_s, 1),
                "cores_median": round(statistics.median(totals), 4), "cores_per_window": [round(t, 4) for t in totals],
                "cores_by_process_median": {g: round(statistics.median(w.get(g, 0.0) for w in windows), 4)
                                            for g in groups}}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        subprocess.run(["ray", "stop", "--force"], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"bench/results/idle-cpu-{datetime.date.today()}.json")
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--log-dir", default="/tmp")
    args = parser.parse_args()
    bare_dir = os.path.join(args.log_dir, "idle-bare-app")
    os.makedirs(bare_dir, exist_ok=True)
    with open(os.path.join(bare_dir, "bare_app.py"), "w") as f:
        f.write(BARE_APP)
    bare = measure("bare_app:app", bare_dir, ("GET", "/", None), args)
    ours = measure("cluster.app", ROOT, ("POST", "/v1/completions",
                                         {"model": "smollm2", "prompt": "Hello", "max_tokens": 8}), args)
    result = {
        "benchmark": "idle_cpu", "environment": environment(),
        "settings": {"window_s": args.window, "windows": args.windows, "settle_s": args.settle,
                     "OMP_NUM_THREADS": 1},
        "anchor_bare_ray_serve": bare, "cluster_app": ours,
        "added_by_cluster_cores": round(ours["cores_median"] - bare["cores_median"], 4),
    }
    write_result(args.out, result)
    print(f"idle: cluster.app {ours['cores_median']:.3f} cores, bare Ray Serve app {bare['cores_median']:.3f}, "
          f"added {result['added_by_cluster_cores']:+.3f}")


if __name__ == "__main__":
    main()
