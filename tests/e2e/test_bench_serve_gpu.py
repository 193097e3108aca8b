"""``bench/serve_gpu.py --tiny``: the single-GPU serving benchmark's whole flow at toy width on this
CPU machine (the real Ray app, both deployments), so the device run it prepares records what the
simulator's validation needs: each rate's requests, what the server said of itself during the run,
and the engine's own step table before and after the deployments."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.e2e.conftest import free_port

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_gpu_serving_benchmark_records_what_the_validation_replays(tmp_path):
    out = tmp_path / "serve-tiny.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)  # its own local Ray instance, as on the device machine
    proc = subprocess.Popen([sys.executable, "bench/serve_gpu.py", "--tiny", "--warmup-ab", "--fresh-triton-cache",
                             "--port", str(free_port()),
                             "--out", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(f"bench/serve_gpu.py --tiny ran past 600 s:\n{log[-3000:]}")
    assert proc.returncode == 0, log[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {}
    assert set(result["modes"]) == {"disagg", "colocated", "disagg-no-warmup", "colocated-no-warmup"}
    for mode, runs in result["modes"].items():
        # what the replicas ran on: a CPU's replicas do not warm up, and say why
        [warmup] = {r["reason"] for r in runs["backends"] if r["component"] == "prefill_warmup"}
        assert ("prefill_warmup=false" if mode.endswith("-no-warmup") else "not needed on cpu") in warmup
        assert runs["replica_warnings"] == []  # no slow step counted on a CPU, nothing compiled
        assert runs["started_s"] > 0 and runs["settings"].get("prefill_warmup", True) is not mode.endswith("-no-warmup")
        for rate, run in runs["runs"].items():
            assert run["completed"] == run["num_requests"] and run["failed"] == 0
            requests = run["requests"]  # kept, for the validation to replay
            assert len(requests) == run["num_requests"]
            assert all(r["prompt_tokens"] > 0 and r["output_tokens"] > 0 for r in requests)
            metrics = run["server_metrics"]
            assert "cluster:prefill_chunk_cap{decode}" in metrics["series"]
            # the replicas' slowest step so far, and no slow step counted (off on a CPU)
            assert max(v for _, v in metrics["series"]["cluster:slowest_step_seconds{decode}"]) > 0
            assert metrics["increase"]["cluster:slow_steps_total"] == 0
            # what held the steps, by role: nothing compiles on a CPU; the collector's seconds counted
            stalls = metrics["stalls"]
            roles = ("decode", "prefill") if mode.startswith("disagg") else ("decode",)
            for role in roles:
                assert stalls[f"cluster:step_kernel_compiles_total{{{role}}}"] == 0
                assert stalls[f"cluster:step_gc_seconds_total{{{role}}}"] >= 0
            count = metrics["increase"]["cluster:request_queue_time_seconds_count"]
            assert count >= run["num_requests"]  # (and the warm-up requests)
            if mode == "disagg":
                assert metrics["increase"]["cluster:ttft_kv_transfer_seconds_count"] >= run["num_requests"]
    steps = result["replica_steps"]
    assert set(steps) == {"before", "after"}
    for table in steps.values():
        assert [r["batch"] for r in table["rows"]] == [1, 2]
        assert all(r["decode_step_ms"] > 0 for r in table["rows"])
        assert sorted({(r["chunk_cap"], r["batch"]) for r in table["mixed"]}) == [
            (8, 0), (8, 1), (8, 2), (16, 0), (16, 1), (16, 2)]
        assert all(r["prompt_tokens"] == r["chunk_cap"] for r in table["mixed"])
        assert table["prefill"] and all(r["prompt_tokens"] > 16 for r in table["prefill"])
