"""The GPU gate: what a change to ``kernels/``, ``cluster/engine/`` or ``cluster/models/`` must pass
on a GPU before it lands (CI has no GPU, so it cannot see a GPU regression).

1. every ``gpu``-marked test (pytest, one process per test file, a few at a time);
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


#: Bytes of KV cache an engine in a gpu test takes when it is not told (tests/conftest.py): the
#: test files run in parallel processes on the one GPU.
TEST_KV_BYTES = 4 << 30
#: Test files run one process per test, not per file: each of their tests builds several engines.
SPLIT_BY_TEST = ("tests/engine/test_gpu_fidelity.py", "tests/engine/test_cuda_graphs.py")


def junit_counts(junit: str) -> dict[str, int]:
    """passed / failed (failures and errors) from one pytest JUnit XML file."""
    suites = ElementTree.parse(junit).getroot()
    suite = suites if suites.tag == "testsuite" else suites[0]
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    return {"passed": total - skipped - failed, "failed": failed}


def run_gpu_tests(workdir: str, timeout_s: float, jobs: int, log_dir: str | None = None) -> dict[str, int]:
    """Every ``gpu``-marked test, one pytest process per test file, ``jobs`` at a time (Triton's
    compiles are CPU-bound, the tests small); a file still running at the deadline counts as a
    failure. Each file's log goes to ``log_dir`` when given, its tail and slowest tests to stdout."""
    files = subprocess.run(["grep", "-rl", "--include=test_*.py", "pytest.mark.gpu", "tests"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    # Only the modules that hold gpu tests: the others may import what the GPU image lacks (openai).
    files.sort(key=lambda f: -os.path.getsize(os.path.join(ROOT, f)))  # the larger first
    split = sorted(set(files) & set(SPLIT_BY_TEST))
    if split:  # the engine tests, one process each, first: they build several LLMs apiece
        listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", *split,
                                 "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True).stdout
        files = [line for line in listed.splitlines() if "::" in line] + [f for f in files if f not in split]
    threads = str(max(1, (os.cpu_count() or 1) // jobs))  # the CPU engines the tests compare against
    env = dict(os.environ, PD_TEST_GPU_KV_BYTES=str(TEST_KV_BYTES), OMP_NUM_THREADS=threads)
    log_dir = log_dir or workdir
    os.makedirs(log_dir, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    pending, running = list(files), {}
    totals = {"passed": 0, "failed": 0}

    def finish(name: str, proc: subprocess.Popen, began: float, log: str, junit: str) -> None:
        code = proc.wait()
        counts = junit_counts(junit) if os.path.exists(junit) else {"passed": 0, "failed": 1}
        if code not in (0, 1, 5) and not counts["failed"]:  # pytest itself failed (usage, internal error)
            counts["failed"] = 1
        with open(log) as f:
            tail = f.read()[-2500:]
        print(f"--- {name}: {counts} in {time.monotonic() - began:.0f} s (exit {code})\n{tail}")
        for key in totals:
            totals[key] += counts[key]

    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in os.path.basename(name).replace(".py", ""))
            log, junit = os.path.join(log_dir, f"{stem}.log"), os.path.join(workdir, f"{stem}.xml")
            cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", name, "-p", "no:cacheprovider",
                   "--durations=5", f"--junitxml={junit}"]
            out = open(log, "w")
            running[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT),
                             time.monotonic(), log, junit, out)
        for name, (proc, began, log, junit, out) in list(running.items()):
            if proc.poll() is not None:
                out.close()
                del running[name]
                finish(name, proc, began, log, junit)
        if time.monotonic() > deadline:
            for name, (proc, began, log, junit, out) in running.items():
                proc.kill()
                proc.wait()
                out.close()
                with open(log) as f:
                    tail = f.read()[-1500:]
                print(f"--- {name}: timed out after {timeout_s:.0f} s\n{tail}")
                totals["failed"] += 1
            print(f"gpu tests: not started by the deadline: {pending}" if pending else "")
            totals["failed"] += len(pending)
            break
        time.sleep(0.5)
    return totals


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
    parser.add_argument("--tests-timeout-s", type=float, default=300.0)
    parser.add_argument("--jobs", type=int, default=6, help="gpu test files run at once")
    parser.add_argument("--log-dir", default=None, help="where each test file's pytest log goes")
    args = parser.parse_args(argv)
    import torch
    env = environment()
    result: dict[str, Any] = {"commit": env["commit"], "device": env["device"]}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        result["tests"] = run_gpu_tests(workdir, args.tests_timeout_s, args.jobs, args.log_dir)
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
