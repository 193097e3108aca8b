"""bench/deepseek_v4_layers.py end to end at toy widths on CPU (``--tiny``), so that the script
does not first fail on the GPU machine: every section runs, every layer gets a time, a roofline
and its bytes, the JSON is written."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch


def _once(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    def run(fn: Callable[[], Any]) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return run


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke test (the GPU runs the real script)")
def test_tiny_run_writes_every_section(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.deepseek_v4_layers as bench

    monkeypatch.setattr(bench, "timer", _once)
    out = tmp_path / "v4.json"
    results = bench.main(["--tiny", "--out", str(out)])
    errors = {k: v["error"] for k, v in results.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    assert json.loads(out.read_text())["config"]["layers"] == bench.LAYERS
    kernels = {row["component"]: row["impl"] for row in results["model"]["kernels"]}
    assert kernels["v4_sparse_attention"] == "torch" and kernels["moe"] == "torch"
    assert {"prefill", "decode_b1", "decode_b3"} <= set(results)
    for name in ("prefill", "decode_b1", "decode_b3"):
        rows = results[name]["layers"]
        assert [r["type"] for r in rows] == bench.LAYERS
        for r in rows:
            assert r["ms"] > 0 and r["roofline_ms"] > 0 and r["percent_of_roofline"] > 0
            assert r["weight_bytes"] > 0 and r["kv_bytes"] > 0 and 0 < r["experts_touched"] <= 8
    decode = results["decode_b1"]["layers"]
    assert decode[0]["kv_bytes"] < decode[1]["kv_bytes"]  # CSA reads compressed entries and indexer keys too
    assert not any("ERROR" in line for line in bench.summary(results))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke test (the GPU runs the real script)")
def test_v4_engine_decode_bench_tiny_run(tmp_path) -> None:
    """bench/v4_decode_gpu.py at toy widths on CPU (eager rows only): the engine decodes through
    dummy weights and every row gets a step time and the bytes of its roofline."""
    import bench.v4_decode_gpu as bench

    out = tmp_path / "v4-decode.json"
    result = bench.main(["--tiny", "--device", "cpu", "--out", str(out)])
    assert not result["errors"], result["errors"]
    assert json.loads(out.read_text())["rows"].keys() == {"eager-b1", "eager-b3"}
    b1, b3 = result["rows"]["eager-b1"], result["rows"]["eager-b3"]
    for row in (b1, b3):
        assert row["step_ms"] > 0 and row["steps_timed"] > 0 and row["dense_bytes"] > 0
    # a larger batch touches more experts and reads three times the KV
    assert b3["routed_expert_bytes"] > b1["routed_expert_bytes"] and b3["kv_bytes"] == 3 * b1["kv_bytes"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke test (the GPU runs the real script)")
def test_v4_mtp_bench_tiny_run(tmp_path) -> None:
    """bench/v4_mtp_gpu.py at toy widths on CPU: every row (no speculation, verify alone, MTP at a
    set acceptance) gets a step time; a set acceptance of 1 takes k + 1 tokens a step, 0 takes one,
    and the engine's own acceptance rule is back in place afterwards."""
    import bench.v4_mtp_gpu as bench
    from cluster.engine import spec_decode, step_loop

    result = bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path / "v4-mtp.json")])
    assert not result["errors"], result["errors"]
    rows = result["rows"]
    assert {"none-b1", "verify-k2-b2", "mtp-k1-a0.0-b1", "mtp-k2-a1.0-b2"} <= rows.keys()
    assert all(row["step_ms"] > 0 for row in rows.values())
    assert rows["mtp-k2-a1.0-b1"]["tokens_per_step"] == 3.0 and rows["mtp-k2-a0.0-b1"]["tokens_per_step"] == 1.0
    assert "draft_over_decode" in rows["mtp-k1-a0.0-b1"] and "speedup_over_none" in rows["mtp-k1-a1.0-b2"]
    assert step_loop.accepted_length is spec_decode.accepted_length
    assert result["fast_paths"]["mtp-k1"]["draft_graphs"].startswith("off: the device is cpu")  # said, not hidden


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke test (the GPU runs the real script)")
def test_v4_dspark_bench_tiny_run(tmp_path) -> None:
    """bench/v4_dspark_gpu.py at toy widths on CPU: every row (no speculation, a verify step of 5
    alone, MTP-1 and DSpark blocks at a set acceptance) gets a step time; a set acceptance of 1
    takes a whole block and its bonus token a step; the hand-over is made and checked; the
    unpipelined DSpark verify steps are said, not hidden."""
    import bench.v4_dspark_gpu as bench
    from cluster.engine import spec_decode, step_loop

    result = bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path / "v4-dspark.json")])
    assert not result["errors"], result["errors"]
    rows = result["rows"]
    assert {"none-b1", "verify-k5-b2", "mtp-k1-a0.0-b1", "dspark-k5-a1.0-b2", "handover"} <= rows.keys()
    assert rows["dspark-k5-a1.0-b1"]["tokens_per_step"] == 6.0 and rows["dspark-k5-a0.0-b1"]["tokens_per_step"] == 1.0
    assert "speedup_over_mtp1" in rows["dspark-k5-a1.0-b2"] and "draft_over_decode" in rows["dspark-k5-a0.0-b1"]
    handover = rows["handover"]
    assert handover["checked_ok"] and handover["drafter_kv_bytes"] > 0 and handover["handover_bytes"] > 0
    paths = result["fast_paths"]["dspark-k5"]
    assert "no pipelined verify steps" in paths["spec_pipeline_status"]
    # asked for (the bench's default), the block graphs cannot be captured on a CPU: said, and counted
    assert "the device is cpu" in paths["draft_graphs"] and paths["graph_blocks"] == 0 and paths["eager_blocks"] > 0
    assert step_loop.accepted_length is spec_decode.accepted_length


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke test (the GPU runs the real script)")
def test_v4_mtp_bench_compares_synchronous_verify_steps_in_the_same_run(tmp_path) -> None:
    """``--compare-sync``: beside each MTP engine, one with pipelined_verify_kv_groups off (its
    verify steps synchronous, said in its fast paths), rows of their own, and the pipelined row's
    ratio over it."""
    import bench.v4_mtp_gpu as bench

    result = bench.main(["--tiny", "--device", "cpu", "--compare-sync", "--ks", "1", "--batches", "1",
                         "--out", str(tmp_path / "v4-mtp-sync.json")])
    assert not result["errors"], result["errors"]
    rows = result["rows"]
    assert {"mtp-k1-a1.0-b1", "mtp-sync-k1-a1.0-b1", "mtp-sync-k1-a0.0-b1"} <= rows.keys()
    assert rows["mtp-sync-k1-a1.0-b1"]["tokens_per_step"] == 2.0 and rows["mtp-sync-k1-a1.0-b1"]["step_ms"] > 0
    pipelined, sync = rows["mtp-k1-a1.0-b1"], rows["mtp-sync-k1-a1.0-b1"]
    assert pipelined["pipelined_over_sync"] == pytest.approx(pipelined["output_tok_s"] / sync["output_tok_s"])
    assert "speedup_over_none" in sync
    assert "pipelined_verify_kv_groups is off" in result["fast_paths"]["mtp-sync-k1"]["spec_pipeline_status"]
    assert "pipelined_verify_kv_groups is off" not in result["fast_paths"]["mtp-k1"]["spec_pipeline_status"]


def test_v4_mtp_speedup_plot_marks_the_anchors(tmp_path) -> None:
    """bench/plot_v4_mtp.py on a committed GPU result: a panel per batch, a curve per draft length
    (synchronous rows apart from pipelined ones), the anchors' acceptance read right (3.1 tokens a
    step at k = 3 is a per-draft acceptance of about 0.83), the PNG written; a result without MTP
    rows is refused."""
    import os

    import bench.plot_v4_mtp as plot

    assert plot.per_draft_acceptance(3.1, 3) == pytest.approx(0.8317, abs=1e-3)
    assert plot.per_draft_acceptance(4.0, 3) == pytest.approx(1.0, abs=1e-9)
    result = json.load(open(os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results",
                                         "v4-mtp-h100-2026-12-05-pipelined.json")))
    result["rows"]["mtp-sync-k3-a1.0-b1"] = {"speedup_over_none": 0.9}
    drawn = plot.plot(result, str(tmp_path / "speedup.png"))
    assert (tmp_path / "speedup.png").stat().st_size > 10_000
    assert drawn["batches"] == [1, 8, 32] and drawn["v3_band"] == [0.85, 0.9]
    curve = drawn["curves"][1]["mtp-k3"]
    assert [a for a, _ in curve] == [0.0, 0.5, 0.8, 1.0]
    assert curve[-1][1] == pytest.approx(result["rows"]["mtp-k3-a1.0-b1"]["speedup_over_none"])
    assert drawn["curves"][1]["mtp-sync-k3"] == [(1.0, 0.9)]
    with pytest.raises(ValueError, match="no mtp"):
        plot.plot({"rows": {"none-b1": {"step_ms": 1.0}}}, str(tmp_path / "none.png"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke test (the GPU runs the real script)")
def test_v4_prefill_profile_tiny_run(tmp_path) -> None:
    """bench/v4_prefill_profile.py at toy widths through the Triton interpreter: every layer, its
    attention and its MoE get a time and a kernel table; the sweeps time the kernel's own tile and a
    candidate it lacks (the sparse attention's at the prefill's arguments, the fused MoE's w13 at
    128-row expert blocks) and name the fastest."""
    import bench.v4_prefill_profile as bench

    out = tmp_path / "v4-prefill.json"
    result = bench.main(["--tiny", "--out", str(out)])
    assert json.loads(out.read_text())["tokens"] == result["tokens"] > 0
    parts = result["parts"]
    assert [(p["layer"], p["part"]) for p in parts] == [(i, part) for i in range(4) for part in ("layer", "attention", "moe")]
    for p in parts:
        assert p["ms"] > 0 and p["kernels"] and p["kernel_us_per_call"] > 0
    assert set(result["sweeps"]) == {"attention_csa", "moe_w13_m128"}
    for name, s in result["sweeps"].items():
        assert "error" not in s, (name, s.get("error"))
        timed = [c for c in s["configs"] if "ms" in c]
        assert len(timed) == 2 and {c["in_list"] for c in timed} == {True, False}
        assert s["best"] == timed[0] and s["autotuned_ms"] > 0 and s["speedup"] > 0
