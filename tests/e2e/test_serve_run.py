"""The README's run command as an operator types it: ``serve run cluster.app`` with no arguments
serves the embedded default model (SmolLM2) disaggregated on this CPU machine at
127.0.0.1:8000, and answers the official openai client."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest

from tests.e2e.conftest import Cluster, httpx

pytestmark = pytest.mark.e2e
BASE = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def served():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)  # a fresh local Ray instance, as on an operator's machine
    serve_cli = shutil.which("serve") or os.path.join(os.path.dirname(sys.executable), "serve")
    proc = subprocess.Popen([serve_cli, "run", "cluster.app"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"serve run exited:\n{proc.stdout.read() if proc.stdout else ''}")
            try:
                if httpx.get(f"{BASE}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise AssertionError("serve run cluster.app did not become healthy in 300 s")
        yield proc
    finally:
        _signal(proc, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def test_default_app_answers_the_openai_client(served):
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none")
    models = [m.id for m in client.models.list().data]
    assert models == ["SmolLM2-135M-Instruct"]
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=models[0], messages=question, temperature=0, max_tokens=20)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens > 0
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=models[0], messages=question, temperature=0, max_tokens=20, stream=True) if chunk.choices)
    assert streamed == reply.choices[0].message.content
    # /health answers once a replica can serve (a decode replica prefills alone); on a busy
    # machine the prefill replica may still be loading then: it reports within a minute
    backends = Cluster._poll(lambda: httpx.get(f"{BASE}/v1/backends", timeout=10).json(),
                             lambda rows: {b["role"] for b in rows} >= {"prefill", "decode"}, 60.0)
    assert {b["role"] for b in backends} >= {"prefill", "decode"}
    # Whether decode runs as CUDA graphs, per replica, with the reason when it does not.
    graphs = {b["role"]: b for b in backends if b["component"] == "cuda_graphs"}
    assert graphs["decode"]["impl"] == "off" and "the device is cpu" in graphs["decode"]["reason"]
    assert "prefill role" in graphs["prefill"]["reason"]
    metrics = httpx.get(f"{BASE}/metrics", timeout=10).text
    assert re.search(r'^cluster:cuda_graphs_captured\{model_name="SmolLM2-135M-Instruct",replica="[^"]+",role="decode"\} 0\.0$',
                     metrics, re.M), metrics


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return f"pid {pid} (gone)"


def test_idle_service_leaves_the_cpu_idle(served):
    """With no request in flight the default service (``auto`` transport) starts no busy-polling
    NIXL agent on one node: its UCX progress threads kept about 1.5 of 2 cores busy (1.0 measured
    here with ``kv_transfer=nixl``). Measured idle here (bench/idle_cpu.py, medians of 10 s
    windows): 0.21 core in all, against 0.16 for a bare Ray Serve application of the same shape
    (four do-nothing deployments) in the same run: Ray's controller, dashboard, GCS, proxy and
    raylet take about 0.12 whatever the application; this project adds 0.045 (engine loops,
    stats reports, the ingress's cluster view). A total under 0.1 core is below Ray Serve's own
    floor on this machine."""
    from bench.common import cpu_by_group, process_cpu_seconds

    # Idle is a steady state: the median of three windows, as bench/idle_cpu.py reports. One window
    # alone failed in CI (0.68 core: 0.40 in processes no group names, 0.22 in the dashboard) while
    # the other test worker loaded the machine; a process born mid-window counts all its start-up
    # CPU, so the message names those that were.
    time.sleep(3.0)  # let the first requests' work drain
    window, totals, detail = 6.0, [], []
    for _ in range(3):
        before = process_cpu_seconds(served.pid)
        time.sleep(window)
        after = process_cpu_seconds(served.pid)
        used = {group: t / window for group, t in cpu_by_group(before, after).items()}
        totals.append(sum(used.values()))
        born = [_cmdline(pid)[:80] for pid in after.keys() - before.keys()]
        detail.append((round(totals[-1], 2), sorted(used.items(), key=lambda kv: -kv[1])[:4], born))
    assert sorted(totals)[1] < 0.5, f"idle service used a median {sorted(totals)[1]:.2f} cores: {detail}"
