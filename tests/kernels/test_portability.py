"""Every Triton kernel builds for sm_90 and sm_120 (no GPU needed: Triton ships ptxas), and on
sm_120 every configuration its autotuner would try fits the 99 KB of shared memory per block
(the others are pruned before they are compiled). The DeepSeek-V4 kernels: the same check in
``test_deepseek_v4_kernels.py``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.kernels.aot import SM120_SHARED_LIMIT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_kernels_compile_for_sm90_and_sm120() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.kernels.portability_check"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    failures = [r for r in records if "error" in r]
    assert not failures, json.dumps(failures, indent=1)
    kernels = {r["kernel"] for r in records}
    assert {"decode", "prefill", "sampling", "moe_w13_mxfp4_m16", "moe_w2_nvfp4_m64", "linear_m1"} <= kernels
    for name in kernels:  # every config an sm_120 autotuner would try fits its shared memory
        sm120 = [(r["shared"], r["config"]) for r in records if r["kernel"] == name and r["arch"] == "sm_120"]
        assert sm120 and all(shared <= SM120_SHARED_LIMIT for shared, _ in sm120), (name, sm120)
