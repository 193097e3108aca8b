"""The GPU gate: what a change to ``kernels/``, ``cluster/engine/`` or ``cluster/models/`` must pass
on a GPU before it lands (CI has no GPU, so it cannot see a GPU regression).

1. every ``gpu``-marked test (pytest, one process per test, several at a time);
2. decode CUDA graphs captured, and their self-check passed, for a Llama-family model and for
   DeepSeek-V4 (small random checkpoints, the tests' factories): ``captured`` or ``off: <reason>``,
   and their start-up prefill warm-up run (``warmed: <lengths, seconds>`` or ``off: <reason>``);
3. engine decode at batch 1 and 32 on the Qwen3-8B-shaped bench model (``bench/engine_gpu.py``'s
   rows, 512-token prompts, pipelined graphs) as a percentage of the roofline from the copy
   bandwidth measured in the same run.

Writes exactly ``{"commit", "device", "tests": {"passed", "failed"}, "graphs": {"llama",
"deepseek_v4"}, "prefill_warmup": {"llama", "deepseek_v4"}, "decode_pct_of_roofline": {"b1",
"b32"}}`` and exits non-zero on any failure (a failed or erroring test, graphs or the warm-up
off, a decode row missing). Start-up seconds and the other
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
#: tests run in parallel processes on the one GPU.
TEST_KV_BYTES = 4 << 30


def junit_counts(junit: str) -> dict[str, int]:
    """passed / failed (failures and errors) from one pytest JUnit XML file."""
    suites = ElementTree.parse(junit).getroot()
    suite = suites if suites.tag == "testsuite" else suites[0]
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    return {"passed": total - skipped - failed, "failed": failed}


def gpu_test_ids() -> list[str]:
    """Every ``gpu``-marked test's node id, those that build engines first (the slowest)."""
    files = subprocess.run(["grep", "-rl", "--include=test_*.py", "pytest.mark.gpu", "tests"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    # Only the modules that hold gpu tests: the others may import what the GPU image lacks (openai).
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", *sorted(files),
                             "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True)
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    if not ids:
        raise RuntimeError(f"no gpu tests collected:\n{listed.stdout[-3000:]}{listed.stderr[-2000:]}")
    return sorted(ids, key=lambda i: (not i.startswith("tests/engine/"), -os.path.getsize(os.path.join(ROOT, i.split("::")[0]))))


def run_gpu_tests(workdir: str, timeout_s: float, jobs: int, log: str | None = None) -> dict[str, Any]:
    """Every ``gpu``-marked test, one pytest process per test, ``jobs`` at a time on the one GPU
    (Triton's compiles and autotuning are CPU-bound, the tests small); a test still running at the
    deadline, or not started by it, counts as a failure. Each test's time and outcome go to
    stdout, the failures' output too, and every test's pytest output to ``log`` when given."""
    try:
        pending = gpu_test_ids()
    except RuntimeError as exc:
        print(exc)
        return {"passed": 0, "failed": 1}
    threads = str(max(1, (os.cpu_count() or 1) // jobs))  # the CPU engines some tests compare against
    env = dict(os.environ, PD_TEST_GPU_KV_BYTES=str(TEST_KV_BYTES), OMP_NUM_THREADS=threads)
    deadline = time.monotonic() + timeout_s
    running: dict[str, tuple[subprocess.Popen, float, str, str]] = {}
    totals = {"passed": 0, "failed": 0}
    logs: list[str] = []
    #: Tests that ran out of GPU memory beside others: each runs once more, alone, at the end, and
    #: counts as that run says (the result names them); any other failure counts at once.
    out_of_memory: list[str] = []
    rerun_alone: list[str] = []

    def done(name: str, proc: subprocess.Popen, began: float, out: str, junit: str, timed_out: bool) -> None:
        with open(out, errors="replace") as f:
            text = f.read().replace("\r", "\n")
        if timed_out:
            counts, what = {"passed": 0, "failed": 1}, f"timed out after {timeout_s:.0f} s"
        else:
            counts = junit_counts(junit) if os.path.exists(junit) else {"passed": 0, "failed": 1}
            if proc.returncode not in (0, 1, 5) and not counts["failed"]:  # pytest itself failed
                counts["failed"] = 1
            what = "FAILED" if counts["failed"] else "passed" if counts["passed"] else "skipped"
        if (counts["failed"] and not timed_out and name not in rerun_alone and jobs > 1
                and "OutOfMemoryError" in text):
            print(f"{time.monotonic() - began:6.1f} s  out of GPU memory beside other tests, rerun alone: {name}")
            logs.append(f"===== {name}: out of GPU memory beside other tests (rerun alone)\n{text}")
            out_of_memory.append(name)
            return
        print(f"{time.monotonic() - began:6.1f} s  {what}  {name}")
        if counts["failed"]:
            print(text[-3000:])
        logs.append(f"===== {name}: {what}\n{text}")
        for key in totals:
            totals[key] += counts[key]

    while pending or running or out_of_memory:
        if not pending and not running:  # the out-of-memory ones, one at a time
            rerun_alone.append(out_of_memory.pop(0))
            pending.append(rerun_alone[-1])
        while pending and len(running) < (1 if rerun_alone else jobs):
            name = pending.pop(0)
            out, junit = (os.path.join(workdir, f"test{len(logs) + len(running)}-{time.monotonic_ns()}.{ext}")
                          for ext in ("log", "xml"))
            with open(out, "w") as sink:
                proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", name, "-p", "no:cacheprovider",
                                         f"--junitxml={junit}"], cwd=ROOT, env=env, stdout=sink,
                                        stderr=subprocess.STDOUT)
            running[name] = (proc, time.monotonic(), out, junit)
        for name, (proc, began, out, junit) in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                done(name, proc, began, out, junit, False)
        if time.monotonic() > deadline:
            for name, (proc, began, out, junit) in running.items():
                proc.kill()
                proc.wait()
                done(name, proc, began, out, junit, True)
            if pending:
                print(f"not started by the deadline ({len(pending)}): {pending}")
            totals["failed"] += len(pending) + len(out_of_memory)
            break
        time.sleep(0.2)
    if log:
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
        with open(log, "w") as f:
            f.write("\n".join(logs))
    return dict(totals, rerun_alone=rerun_alone) if rerun_alone else totals


def graph_state(make: Any, label: str) -> tuple[str, str]:
    """``captured`` or ``off: <reason>`` for an LLM built by ``make`` (timed: start-up to stdout),
    and what its start-up prefill warm-up did (``warmed: ...`` or ``off: <reason>``)."""
    start = time.perf_counter()
    try:
        llm = make()
    except Exception as exc:  # noqa: BLE001 - the gate reports it
        return f"off: start-up failed: {exc!r}", "off: start-up failed"
    engine = llm.engine
    print(f"{label}: ready in {time.perf_counter() - start:.1f} s; start-up phases "
          + json.dumps({k: round(v, 2) for k, v in engine.startup_timings.items()}))
    status = engine.runner.graph_status
    print(f"{label}: decode CUDA graphs {status.describe()}; prefill warm-up: {engine.prefill_warmup_status}")
    warmup = f"{'warmed' if engine.prefill_warmup_lengths else 'off'}: {engine.prefill_warmup_status}"
    return ("captured" if status.captured else f"off: {status.reason}"), warmup


def check_graphs(workdir: str) -> dict[str, tuple[str, str]]:
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
    parser.add_argument("--jobs", type=int, default=10, help="gpu tests run at once")
    parser.add_argument("--log", default=None, help="where every gpu test's pytest output goes")
    args = parser.parse_args(argv)
    import torch
    env = environment()
    result: dict[str, Any] = {"commit": env["commit"], "device": env["device"]}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        result["tests"] = run_gpu_tests(workdir, args.tests_timeout_s, args.jobs, args.log)
        print(f"gpu tests: {result['tests']} ({time.perf_counter() - start:.0f} s)")
        try:  # first, while the GPU's memory is all free (the KV cache is sized from it)
            result["decode_pct_of_roofline"] = decode_pct()
        except Exception as exc:  # noqa: BLE001 - the gate reports it
            print(f"engine decode failed: {exc!r}")
            result["decode_pct_of_roofline"] = {"b1": None, "b32": None}
        gc.collect()
        torch.cuda.empty_cache()
        states = check_graphs(workdir)
        result["graphs"] = {model: graphs for model, (graphs, _) in states.items()}
        result["prefill_warmup"] = {model: warmup for model, (_, warmup) in states.items()}
    result = {key: result[key] for key in ("commit", "device", "tests", "graphs", "prefill_warmup",
                                           "decode_pct_of_roofline")}
    write_result(args.out, result)
    ok = (result["tests"]["failed"] == 0 and result["tests"]["passed"] > 0
          and all(v == "captured" for v in result["graphs"].values())
          and all(v.startswith("warmed") for v in result["prefill_warmup"].values())
          and all(v is not None for v in result["decode_pct_of_roofline"].values()))
    print(json.dumps(result), f"\ngpucheck {'passed' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
