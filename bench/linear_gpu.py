"""Decode-shaped linear layers on a GPU: the Triton skinny kernel (``kernels.triton_linear``)
against cuBLAS (``torch.nn.functional.linear``) and the HBM roofline, measured in the same run.

Shapes: the four projections of a Qwen3-8B layer (qkv 6144x4096, o 4096x4096, down 4096x12288,
and gate/up 24576x4096 gated: the Triton kernel writes SwiGLU(gate, up) from its epilogue, cuBLAS
is timed with the separate SwiGLU kernel after it, as the unfused model runs), at M = 1..32 rows
(decode batches).

Timing: each measurement is a CUDA graph of one call per weight copy over ``copies`` distinct
weight copies (together larger than the 50 MB L2, so every call reads its weight from HBM),
replayed; the time per call is the replay median / copies. This is how the layers run in the
engine's decode graphs (no launch overhead from Python). Roofline: (weight + activation bytes) /
the device-to-device copy bandwidth (read + written) measured here.

For the Triton kernel every config of a sweep is timed (``sweep``) and the best reported, with the
autotuned choice (what the engine runs) next to it. Correctness: every output is compared with
cuBLAS in float32 (relative max error), never on zeros.

    python3 bench/linear_gpu.py --out bench/results/linear-h200-<date>.json
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, graph_seconds_per_call, write_result  # noqa: E402
from bench.engine_gpu import copy_bandwidth  # noqa: E402
from kernels.triton_activation import silu_and_mul_triton  # noqa: E402
from kernels.triton_linear import skinny_linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (24576, 4096, True),
          "down": (4096, 12288, False)}  # name: (N, K, gated)
ROWS = (1, 2, 4, 8, 16, 32)


def sweep_configs() -> list[dict[str, int]]:
    out = []
    for bn in (8, 16, 32, 64):
        for bk in (128, 256, 512):
            for warps, stages in ((4, 3), (4, 4), (8, 3)):
                if bn * bk > 256 * 32 * warps:  # more than 64 fp32 products per thread: spills
                    continue
                out.append({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages})
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"bench/results/linear-h200-{datetime.date.today()}.json")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping after this long")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--sweep-rows", default="1,32", help="rows at which every config is timed")
    args = parser.parse_args()
    device = torch.device("cuda")
    t0 = time.time()
    bw = copy_bandwidth(device)
    result: dict[str, Any] = {"benchmark": "skinny-linear", "environment": environment(),
                              "copy_bandwidth_GBps": bw / 1e9, "units": "us per call; GB/s of weight + "
                              "activation bytes; pct = roofline time / measured time",
                              "sweep_configs": sweep_configs(), "rows": [], "errors": {}}
    gen = torch.Generator(device=device).manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    sweep_rows = {int(r) for r in args.sweep_rows.split(",")}
    for name, (n, k, gated) in SHAPES.items():
        wbytes = n * k * 2
        copies = max(2, -(-256 * 2**20 // wbytes))  # >= 256 MB of weights per graph: no L2 reuse
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) / k ** 0.5
              for _ in range(copies)]
        for m in rows:
            if time.time() - t0 > args.budget_s:
                result["errors"][f"{name}-m{m}"] = "budget spent"
                continue
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
            moved = wbytes + x.numel() * 2 + m * n * 2
            roof = moved / bw  # HBM moves bw bytes/s (read + written), a GEMV's are nearly all reads
            ref = silu_and_mul_triton(F.linear(x, ws[0])) if gated else F.linear(x, ws[0])
            row: dict[str, Any] = {"shape": name, "N": n, "K": k, "gated": gated, "M": m, "copies": copies,
                                   "roofline_us": roof * 1e6}
            try:
                if gated:
                    cublas = graph_seconds_per_call(lambda i: silu_and_mul_triton(F.linear(x, ws[i])), copies)
                else:
                    cublas = graph_seconds_per_call(lambda i: F.linear(x, ws[i]), copies)
                row["cublas_us"] = cublas * 1e6
                row["cublas_pct"] = 100 * roof / cublas
                auto = graph_seconds_per_call(lambda i: skinny_linear(x, ws[i], gated=gated), copies)
                row["triton_auto_us"] = auto * 1e6
                row["triton_auto_pct"] = 100 * roof / auto
                row["triton_auto_err"] = rel_err(skinny_linear(x, ws[0], gated=gated), ref)
                best, best_cfg, sweep = float("inf"), None, []
                for cfg in (sweep_configs() if m in sweep_rows else []):
                    if time.time() - t0 > args.budget_s:
                        break
                    try:
                        out = skinny_linear(x, ws[0], gated=gated, config=cfg)
                        err = rel_err(out, ref)
                        t = graph_seconds_per_call(lambda i, c=cfg: skinny_linear(x, ws[i], gated=gated, config=c),
                                       copies, replays=10)
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile
                        sweep.append({**cfg, "error": repr(exc)[:200]})
                        continue
                    sweep.append({**cfg, "us": t * 1e6, "err": err})
                    if t < best and err < 2e-2:
                        best, best_cfg = t, cfg
                row.update(auto_vs_cublas=cublas / auto)
                if sweep:
                    row.update(triton_best_us=best * 1e6, triton_best_pct=100 * roof / best,
                               triton_best_config=best_cfg, best_vs_cublas=cublas / best, sweep=sweep)
            except Exception as exc:  # noqa: BLE001 - record and go on
                result["errors"][f"{name}-m{m}"] = repr(exc)[:500]
            result["rows"].append(row)
            print(name, m, {k2: (round(v, 2) if isinstance(v, float) else v) for k2, v in row.items()
                            if k2 != "sweep"}, flush=True)
        del ws
        torch.cuda.empty_cache()
    result["total_s"] = time.time() - t0
    write_result(args.out, result)


if __name__ == "__main__":
    main()
