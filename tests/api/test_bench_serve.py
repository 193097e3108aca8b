"""bench/serve.py against the fake server: a handful of requests, the result JSON's fields, the
CLI and the plot."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from tests.api.conftest import SERVED_NAME
from tests.api.fakes import Script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serve", os.path.join(ROOT, "bench", "serve.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", [{"concurrency": 2}, {"rate": 100.0, "concurrency": 4}])
def test_run_benchmark_reports_latencies_and_goodput(fake, base_url, bench, mode):
    fake.script = lambda request: Script(delay=0.002)
    config = bench.BenchConfig(base_url=base_url, model=SERVED_NAME, num_requests=6, input_len=10, output_len=5,
                               input_len_range=0.5, token_id_range=(3, 200), ttft_target_s=10, itl_target_s=10,
                               seed=3, label="fake", **mode)
    result = bench.run_benchmark(config)
    assert (result["num_requests"], result["completed"], result["failed"]) == (6, 6, 0)
    assert result["label"] == "fake" and result["endpoint"] == base_url and result["model"] == SERVED_NAME
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        stats = result[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"], key
    assert result["total_output_tokens"] == 30 and result["goodput_rps"] == result["request_throughput_rps"] > 0
    assert result["output_token_throughput_tps"] > 0 and result["duration_s"] > 0
    records = result["requests"]
    assert all(r["output_tokens"] == 5 and len(r["itl_s"]) == 4 for r in records)
    assert all(5 <= r["prompt_tokens"] <= 15 for r in records)
    timed = fake.requests[1:]  # after the warm-up request
    assert sorted(len(q.prompt_token_ids) for q in timed) == sorted(r["prompt_tokens"] for r in records)
    assert all(q.sampling_params.ignore_eos and q.sampling_params.max_tokens == 5 for q in fake.requests)


def test_server_timings_are_kept_per_request_and_summarized(fake, base_url, bench):
    """``server_timings``: each record keeps the server's ``timings`` (from the choice's last chunk)
    and the result summarizes each part, and the client's TTFT beyond the front end's; without
    it, nothing is asked or kept."""
    parts = {"prefill_queue": 0.001, "prefill_compute": 0.002, "transfer": 0.0005, "first_decode": 0.0007,
             "queue": 0.001, "ttft": 0.004}
    fake.script = lambda request: Script(delay=0.005, timings=dict(parts))
    common = dict(base_url=base_url, model=SERVED_NAME, num_requests=3, input_len=6, output_len=4,
                  token_id_range=(3, 200), concurrency=2, warmup=0)
    result = bench.run_benchmark(bench.BenchConfig(**common, server_timings=True))
    assert result["completed"] == 3
    for record in result["requests"]:
        t = record["server_timings"]
        assert {k: t[k] for k in parts if k != "ttft"} == {k: v for k, v in parts.items() if k != "ttft"}
        assert t["worker_ttft"] == parts["ttft"]
        assert 0 <= t["prepare"] <= t["ttft"] <= record["ttft_s"] and t["ttft"] <= t["e2e"] <= record["e2e_s"]
    summary = result["server_timings_s"]
    assert summary["prefill_compute"]["p50"] == pytest.approx(parts["prefill_compute"])
    assert 0 <= summary["outside_ttft_s"]["p50"] <= result["ttft_s"]["p50"]
    plain = bench.run_benchmark(bench.BenchConfig(**common))
    assert "server_timings_s" not in plain and not any("server_timings" in r for r in plain["requests"])


def test_goodput_counts_only_requests_within_targets(fake, base_url, bench):
    fake.script = lambda request: Script(delay=0.02)
    config = bench.BenchConfig(base_url=base_url, model=SERVED_NAME, num_requests=3, input_len=4, output_len=3,
                               token_id_range=(3, 200), ttft_target_s=0.001, itl_target_s=10, warmup=0)
    result = bench.run_benchmark(config)
    assert result["completed"] == 3 and result["goodput_rps"] == 0 and result["goodput_fraction"] == 0


def test_errors_are_recorded_not_raised(fake, base_url, bench):
    config = bench.BenchConfig(base_url=base_url, model="nope", num_requests=2, input_len=4, output_len=2,
                               token_id_range=(3, 200), warmup=0)
    result = bench.run_benchmark(config)
    assert result["failed"] == 2 and result["completed"] == 0
    [(message, count)] = result["errors"].items()
    assert count == 2 and message.startswith("HTTP 404")  # unknown model


def test_cli_writes_json_and_plot(fake, base_url, bench, tmp_path):
    pytest.importorskip("matplotlib")
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    bench.main(["--base-url", base_url, "--num-requests", "4", "--concurrency", "2", "--input-len", "6",
                "--output-len", "4", "--token-id-range", "3", "200", "--prompt-kind", "text",
                "--out", str(out), "--plot", str(plot), "--label", "cli"])
    result = json.loads(out.read_text())
    assert result["model"] == SERVED_NAME and result["completed"] == 4  # the model came from /v1/models
    assert result["command"].startswith("python bench/serve.py --base-url") and result["label"] == "cli"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    spec = importlib.util.spec_from_file_location("bench_plot_serve", os.path.join(ROOT, "bench", "plot_serve.py"))
    plot_serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_serve)
    compare = tmp_path / "compare.png"
    plot_serve.main([str(out), str(out), "--out", str(compare)])
    assert compare.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
