"""Where a decode step's GPU time goes: the engine's decode steps (Qwen3-8B shape, random bf16
weights, CUDA graphs, pipelined) under ``torch.profiler``, kernel time summed by kernel name and
divided by the steps profiled, next to the step's wall time and its HBM roofline (weight + KV bytes
/ the copy bandwidth measured in the same run).

    python3 bench/decode_profile.py --out bench/results/decode-profile-h200-<date>.json [--batches 1,32]
        [--linear torch]   # dense projections through torch (cuBLAS) instead of the dispatched kernel
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, median, write_result  # noqa: E402
from bench.engine_gpu import (QWEN3_8B, TINY, add_random_requests, copy_bandwidth, make_engine,  # noqa: E402
                              random_model, weight_bytes)


#: Kernel names are cut to this many characters (templated names run to thousands).
KERNEL_NAME_CHARS = 160


def profiled_steps(engine: Any, steps: int, activities: list[Any]) -> tuple[Any, list[float]]:
    """``steps`` engine steps under ``torch.profiler`` with ``activities`` (synchronised before and
    after when CUDA is among them), then the engine run dry: (the profile, the interval between
    step returns)."""
    cuda = torch.profiler.ProfilerActivity.CUDA in activities
    if cuda:
        torch.cuda.synchronize()
    walls = []
    with torch.profiler.profile(activities=activities) as prof:
        last = time.perf_counter()
        for _ in range(steps):
            engine.step()
            now = time.perf_counter()
            walls.append(now - last)
            last = now
        if cuda:
            torch.cuda.synchronize()
    while engine.has_work():
        engine.step()
    return prof, walls


def kernel_times(prof: Any) -> dict[str, list[float]]:
    """GPU kernel name -> [microseconds, launches] summed over a profile."""
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name[:KERNEL_NAME_CHARS]]
            k[0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            k[1] += 1
    return kernels


def profile_batch(engine, batch: int, prompt_len: int, steps: int) -> dict[str, Any]:
    add_random_requests(engine, batch, prompt_len, steps + 24, f"p{batch}", seed=batch)
    while any(g.samples[0].num_output_tokens == 0 for g in engine.groups.values()) or \
            len(engine.groups) < batch:  # past every prefill
        engine.step()
    for _ in range(8):
        engine.step()
    prof, walls = profiled_steps(engine, steps, [torch.profiler.ProfilerActivity.CUDA])
    kernels = kernel_times(prof)
    total_us = sum(v[0] for v in kernels.values())
    table: list[dict[str, Any]] = sorted(
        ({"kernel": n, "us_per_step": v[0] / steps, "calls_per_step": v[1] / steps} for n, v in kernels.items()),
        key=lambda r: -float(r["us_per_step"]))
    return {"batch": batch, "steps": steps, "step_wall_ms": 1000 * median(walls[1:]),
            "gpu_kernel_ms_per_step": total_us / steps / 1000,
            "kernel_launches_per_step": sum(v[1] for v in kernels.values()) / steps, "kernels": table[:40]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"bench/results/decode-profile-h200-{datetime.date.today()}.json")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--linear", choices=["dispatch", "torch"], default="dispatch")
    args = parser.parse_args()
    device = torch.device("cuda")
    config: dict[str, Any] = TINY if args.tiny else QWEN3_8B
    bw = copy_bandwidth(device, 0.25 if args.tiny else 2.0)
    loaded = random_model(config, device, "auto")
    if args.linear == "torch":  # every module holding the ops gets the same ops with torch's linear
        from dataclasses import replace

        from kernels.linear import linear_ref
        ops = replace(loaded.model.ops, linear=linear_ref)
        for module in loaded.model.modules():
            if hasattr(module, "ops"):
                module.ops = ops
    wbytes = weight_bytes(loaded.model)
    engine = make_engine(loaded, device, 64, eager=False)
    kv_per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    result: dict[str, Any] = {"benchmark": "decode-profile", "model": "Qwen3-8B-shaped, random bf16 weights",
                              "environment": environment(), "copy_bandwidth_GBps": bw / 1e9, "linear": args.linear,
                              "weight_bytes": wbytes, "kernels_chosen": engine.backends(), "rows": []}
    for b in (int(x) for x in args.batches.split(",")):
        r = profile_batch(engine, b, 512, args.steps)
        r["roofline_ms"] = 1000 * (wbytes + b * 530 * kv_per_token) / bw
        result["rows"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "kernels"}))
        for k in r["kernels"][:25]:
            print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:6.1f}  {k['kernel']}")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
