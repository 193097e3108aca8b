"""Paged decode attention at the engine's decode shapes (Qwen3-8B: 32 q heads, 8 KV heads, d=128,
pages of 16), per launch configuration and split count, timed as the engine runs it: a CUDA graph
of one launch per layer over ``layers`` layers with their own KV (more than the L2 holds), replayed.
Roofline: KV bytes read / the copy bandwidth (read + written) measured in the same run.

    python3 bench/decode_attention_gpu.py --out bench/results/decode-attention-h200-<date>.json
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, graph_seconds_per_call, write_result  # noqa: E402
from bench.engine_gpu import copy_bandwidth  # noqa: E402
from kernels import triton_attention_decode as dec  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
CASES = [(1, 530, 4096), (8, 530, 4096), (32, 530, 4096), (32, 2048, 4096), (64, 4096, 4096)]  # B, ctx, max len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"bench/results/decode-attention-h200-{datetime.date.today()}.json")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--budget-s", type=float, default=150)
    args = parser.parse_args()
    device = torch.device("cuda")
    t0 = time.time()
    bw = copy_bandwidth(device)
    result: dict[str, Any] = {"benchmark": "decode-attention-configs", "environment": environment(),
                              "copy_bandwidth_GBps": bw / 1e9, "layers": args.layers, "rows": []}
    configs = dec.SWEEP_CONFIGS
    gen = torch.Generator(device=device).manual_seed(0)
    for b, ctx, max_len in CASES:
        pages = -(-ctx // PAGE)
        n_blocks = args.layers * b * pages + 1
        k = torch.randn(n_blocks, PAGE, HKV, D, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        perm = torch.randperm(n_blocks - 1, device=device, generator=gen) + 1
        tables = [perm[i * b * pages:(i + 1) * b * pages].view(b, pages).to(torch.int32) for i in range(args.layers)]
        q = torch.randn(b, HQ, D, device=device, dtype=torch.bfloat16, generator=gen)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        kv_bytes = 2 * b * ctx * HKV * D * 2
        roof = kv_bytes / bw
        default_splits = dec.decode_num_splits(b, HKV, max_len, device)
        row: dict[str, Any] = {"batch": b, "context": ctx, "graph_splits": default_splits, "roofline_us": roof * 1e6,
                               "timings": []}
        for splits in sorted({1, 2, 4, 8, 16, default_splits, dec.decode_num_splits(b, HKV, ctx, device)}):
            for cfg in configs:
                if time.time() - t0 > args.budget_s:
                    break

                def launch(i: int, c=cfg, s=splits) -> None:
                    dec.paged_decode_attention(q, k, v, tables[i], lens, max_len, 0.088, num_splits=s, out=out,
                                               config=c)
                try:
                    t = 1e6 * graph_seconds_per_call(launch, args.layers, replays=15, skip=3)
                    row["timings"].append({**cfg, "splits": splits, "us": t, "pct_of_roofline": 100 * roof * 1e6 / t})
                except Exception as exc:  # noqa: BLE001
                    row["timings"].append({**cfg, "splits": splits, "error": repr(exc)[:300]})
        ok = [t for t in row["timings"] if "us" in t]
        if ok:
            row["best"] = min(ok, key=lambda t: t["us"])
        result["rows"].append(row)
        print(b, ctx, "graph splits", default_splits, "roofline", round(roof * 1e6, 2), "best", row.get("best"))
        for t in sorted(ok, key=lambda t: t["us"])[:5]:
            print("   ", t)
        del k, v
        torch.cuda.empty_cache()
    result["total_s"] = time.time() - t0
    write_result(args.out, result)


if __name__ == "__main__":
    main()
