"""bench/kernels.py's sections run end to end on tiny shapes (CPU, interpreter, a wall-clock
timer in place of CUDA events), so the script does not first fail on the GPU machine."""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch


def _timer(fn: Callable[[], Any], graph: bool = False) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke test (the GPU runs the real script)")
def test_sections_on_tiny_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.kernels as bk

    monkeypatch.setattr(bk, "DEV", "cpu")
    monkeypatch.setattr(bk, "bench_ms", _timer)
    results: dict[str, Any] = {"env": {"device": "cpu", "torch": "", "triton": ""}}
    bk.run_section(results, "anchors", lambda: bk.anchors(n=1024, mm=32))
    bk.run_section(results, "decode_attention",
                   lambda: bk.decode_attention(1.0, b=2, ctx=64, hq=4, hkv=2, d=16))
    bk.run_section(results, "prefill_attention",
                   lambda: bk.prefill_attention(s=32, hq=4, d=16, kv_heads=(4, 2)))
    bk.run_section(results, "moe_decode", lambda: bk.moe_decode(
        1.0, ["bf16", "mxfp4", "fp8_block", "nvfp4"], [1], math.inf, e=4, top_k=2, hidden=64,
        inter=32, rotations=2))
    bk.run_section(results, "small_ops", lambda: bk.small_ops(n=16, vocab=300, rows=2, inter=64))
    errors = {k: v["error"] for k, v in results.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    assert results["decode_attention"]["splits"][1]["max_rel_err"] < 1e-2
    assert all(p["max_rel_err"] < 1e-2 for p in results["prefill_attention"].values())
    for fmt, rows in results["moe_decode"]["formats"].items():
        assert rows["1"]["max_rel_err"] < 2e-2, fmt
        assert rows["1"]["fraction_of_roofline_graph"] > 0
    lines = bk.summary(results)
    assert any(line.startswith("decode attn") for line in lines)
    assert not any("ERROR" in line for line in lines)
    json.dumps(results, default=str)
