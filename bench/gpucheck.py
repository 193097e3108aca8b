"""The GPU gate: what a change to ``kernels/``, ``cluster/engine/`` or ``cluster/models/`` must pass
on a GPU before it lands (CI has no GPU, so it cannot see a GPU regression).

1. every ``gpu``-marked test (pytest, in a subprocess);
2. decode CUDA graphs captured, and their self-check passed, for a Llama-family model and for
   DeepSeek-V4 (small random checkpoints, the tests' factories): ``captured`` or ``off: <reason>``;
3. engine decode at batch 1 and 32 on the Qwen3-8B-shaped bench model (``bench/engine_gpu.py``'s
   rows, 512-token prompts, pipelined graphs) as a percentage of the roofline from the copy
   bandwidth measured in the same run.

Writes exactly ``{"commit", "device", "tests": {"passed", "failed"}, "graphs": {"llama",
"deepseek_v4"}, "decode_pct_of_roofline": {"b1", "b32"}}`` and exits non-zero on any failure (a
failed or erroring test, graphs off, a decode row missing). Start-up seconds and the other
details go to standard output only.

    PD_BENCH_COMMIT=<hash> bash bench/gpu_session.sh gpucheck      # on the GPU machine
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, write_result  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Batch 1 and 32 decode on the engine bench model: (name, batch, prompt tokens, new tokens).
DECODE_ROWS = (("b1", 1, 512, 48), ("b32", 32, 512, 48))


def run_gpu_tests(junit: str, timeout_s: float) -> dict[str, int]:
    """Every ``gpu``-marked test; passed / failed (failures and errors) from pytest's JUnit XML."""
    files = subprocess.run(["grep", "-rl", "--include=test_*.py", "pytest.mark.gpu", "tests"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    # Only the modules that hold gpu tests: the others may import what the GPU image lacks (openai).
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", *sorted(files), "-p", "no:cacheprovider",
           "--durations=12", f"--junitxml={junit}"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout_s, capture_output=True, text=True)
        print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n")
    except subprocess.TimeoutExpired as exc:
        print(str(exc.stdout or "")[-4000:], f"gpu tests: timed out after {timeout_s:.0f} s", sep="\n")
        return {"passed": 0, "failed": 1}
    if not os.path.exists(junit):
        return {"passed": 0, "failed": 1}
    suites = ElementTree.parse(junit).getroot()
    suite = suites if suites.tag == "testsuite" else suites[0]
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    if proc.returncode not in (0, 1, 5) and not failed:  # pytest itself failed (usage, internal error)
        failed = 1
    return {"passed": total - skipped - failed, "failed": failed}


def graph_state(make: Any, label: str) -> str:
    """``captured`` or ``off: <reason>`` for an LLM built by ``make`` (timed: start-up to stdout)."""
    start = time.perf_counter()
    try:
        llm = make()
    except Exception as exc:  # noqa: BLE001 - the gate reports it
        return f"off: start-up failed: {exc!r}"
    engine = llm.engine
    print(f"{label}: ready in {time.perf_counter() - start:.1f} s; start-up phases "
          + json.dumps({k: round(v, 2) for k, v in engine.startup_timings.items()}))
    status = engine.runner.graph_status
    print(f"{label}: decode CUDA graphs {status.describe()}")
    return "captured" if status.captured else f"off: {status.reason}"


def check_graphs(workdir: str) -> dict[str, str]:
    from cluster import LLM
    from tests.deepseek_factories import make_v4_checkpoint
    from tests.factories import make_checkpoint

    llama, v4 = os.path.join(workdir, "llama"), os.path.join(workdir, "v4")
    make_checkpoint(llama, "llama", max_position_embeddings=1024)
    make_v4_checkpoint(v4, "csa_hca")
    return {"llama": graph_state(lambda: LLM(llama, dtype="bfloat16", max_num_seqs=8), "llama"),
            "deepseek_v4": graph_state(lambda: LLM(v4, dtype="bfloat16", max_num_seqs=8, max_model_len=512),
                                       "deepseek_v4")}


def decode_pct() -> dict[str, float]:
    import torch

    from bench.engine_gpu import QWEN3_8B, copy_bandwidth, decode_row, make_engine, random_model, weight_bytes
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    loaded = random_model(QWEN3_8B, device, "auto")
    engine = make_engine(loaded, device, max(b for _, b, _, _ in DECODE_ROWS), eager=False)
    print(f"engine bench model: decode CUDA graphs {engine.runner.graph_status.describe()}; "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    out = {}
    for name, batch, prompt, new in DECODE_ROWS:
        row = decode_row(engine, QWEN3_8B, f"gpucheck-{name}", batch, prompt, new, weight_bytes(loaded.model),
                         bandwidth)
        print(f"decode {name}: " + json.dumps({k: round(v, 3) for k, v in row.items()}))
        out[name] = round(row["pct_of_roofline"], 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"bench/results/gpucheck-h200-{datetime.date.today()}.json")
    parser.add_argument("--tests-timeout-s", type=float, default=200.0)
    args = parser.parse_args(argv)
    import torch
    env = environment()
    result: dict[str, Any] = {"commit": env["commit"], "device": env["device"]}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        result["tests"] = run_gpu_tests(os.path.join(workdir, "junit.xml"), args.tests_timeout_s)
        print(f"gpu tests: {result['tests']} ({time.perf_counter() - start:.0f} s)")
        try:  # first, while the GPU's memory is all free (the KV cache is sized from it)
            result["decode_pct_of_roofline"] = decode_pct()
        except Exception as exc:  # noqa: BLE001 - the gate reports it
            print(f"engine decode failed: {exc!r}")
            result["decode_pct_of_roofline"] = {"b1": None, "b32": None}
        gc.collect()
        torch.cuda.empty_cache()
        result["graphs"] = check_graphs(workdir)
    result = {key: result[key] for key in ("commit", "device", "tests", "graphs", "decode_pct_of_roofline")}
    write_result(args.out, result)
    ok = (result["tests"]["failed"] == 0 and result["tests"]["passed"] > 0
          and all(v == "captured" for v in result["graphs"].values())
          and all(v is not None for v in result["decode_pct_of_roofline"].values()))
    print(json.dumps(result), f"\ngpucheck {'passed' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
