"""Issue 5's targets against the committed H200 results: for each row, the measured value, the
target, whether it is met, by how much it is missed, and what limits it (as measured and analysed
in kernels/NOTES.md and the README). Reads bench/results/*.json; writes one JSON.

    python bench/targets.py --engine engine-h200-2026-12-01.json --out bench/results/targets-h200-2026-12-01.json
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load(name: str) -> dict[str, Any]:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def row(what: str, value: float, target: float, unit: str, source: str, limit: str) -> dict[str, Any]:
    met = value >= target
    return {"what": what, "value": round(value, 4), "target": target, "unit": unit, "met": met,
            "missed_by": None if met else round(target - value, 4),
            "missed_by_fraction_of_target": None if met else round((target - value) / target, 4),
            "source": source, "limited_by": None if met else limit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default="kernels-h200-2026-11-29-run3.json")
    parser.add_argument("--engine", default="engine-h200-2026-11-29-run4.json")
    parser.add_argument("--transfer", default="transfer-h200-2026-11-29.json")
    parser.add_argument("--out", default=os.path.join(RESULTS, "targets-h200-2026-11-29.json"))
    args = parser.parse_args()
    k, e, t = load(args.kernels), load(args.engine), load(args.transfer)
    dec, pre = k["decode_attention"], k["prefill_attention"]
    moe = k["moe_decode"]["formats"]
    rows = [
        row("paged decode attention vs SDPA", dec["speedup_vs_sdpa"], 0.9, "x", args.kernels, ""),
        row("paged decode attention bandwidth", dec["triton_tb_s"], 3.6, "TB/s", args.kernels, ""),
        row("prefill attention vs SDPA (32 kv heads)", pre["kv_heads_32"]["ratio_vs_sdpa"], 0.8, "x", args.kernels,
            "Triton 3.6 on sm_90: softmax and the two matrix products serialise per warpgroup (no warp "
            "specialisation); see kernels/NOTES.md"),
        row("prefill attention vs SDPA (8 kv heads)", pre["kv_heads_8"]["ratio_vs_sdpa"], 0.8, "x", args.kernels,
            "as above"),
    ]
    for fmt, by_batch in moe.items():
        worst = min(r["fraction_of_roofline_graph"] for b, r in by_batch.items()
                    if isinstance(r, dict) and "fraction_of_roofline_graph" in r and int(b) <= 64)
        rows.append(row(f"fused MoE decode {fmt}, worst batch <= 64, % of HBM roofline", 100 * worst, 70, "%",
                        args.kernels, "fp4: instruction-bound nibble decode in registers (3.5-3.9 instructions "
                        "per weight); batch 1: fixed launch cost against an 18.8 us floor"))
    b1, b32 = e["rows"]["decode-b1"], e["rows"]["decode-b32"]
    limit = ("GPU time in the decode graph (decode-profile-h200-2026-11-29.json): the projections run at "
             "72-92% of copy bandwidth (the smaller ones lose most: a kernel's ramp-up and tail against 8-50 MB of "
             "weights), two RMSNorms and the q/k prepare per layer (~6.5 us a layer), decode attention at batch "
             "32 and 530 tokens of context at ~66% of its KV roofline; the logits GEMM and sampling run outside "
             "the graph; see kernels/NOTES.md")
    rows.append(row("engine decode batch 1, % of HBM roofline", b1["pct_of_roofline"], 90, "%", args.engine, limit))
    rows.append(row("engine decode batch 32, % of roofline incl. KV", b32["pct_of_roofline"], 80, "%", args.engine, limit))
    rows.append(row("KV transfer ipc, worst size, ratio to raw CUDA IPC", t["target"]["ipc_worst_ratio"], 0.8, "x",
                    args.transfer, "a fixed cost per send (index tensors, kernel launch, synchronisation) that "
                    "dominates small requests; 0.77x at 32k tokens"))
    with open(args.out, "w") as f:
        json.dump({"device": "NVIDIA H200", "rows": rows}, f, indent=1)
    for r in rows:
        print(f"{'met ' if r['met'] else 'MISS'} {r['what']}: {r['value']} {r['unit']} (target {r['target']})")


if __name__ == "__main__":
    main()
