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

from bench.common import cpu_by_group, environment, process_cpu_seconds, write_result  # noqa: E402

try:
    import httpx
except ImportError:
    import httpx2 as httpx  # type: ignore[no-redef]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = "http://127.0.0.1:8000"
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


def measure(import_path: str, cwd: str, probe: tuple[str, str, dict[str, Any] | None], args: Any) -> dict[str, Any]:
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
        windows = []
        for _ in range(args.windows):
            before = process_cpu_seconds(proc.pid)
            time.sleep(args.window)
            seconds = cpu_by_group(before, process_cpu_seconds(proc.pid))
            windows.append({group: t / args.window for group, t in seconds.items()})
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
