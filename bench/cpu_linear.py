"""CPU projections of the embedded default (SmolLM2-135M's shapes), by rows of activations: the
int4 weight-only kernel (the GGUF's 4-bit codes), a bfloat16 GEMM over the dequantized weight,
and float32 ``F.linear``, and the dense product the engine takes (``q4_matmul(dense=True)``: over
a bfloat16 copy where oneDNN multiplies bfloat16 natively, else a float32 one:
``kernels.cpu_quant.dense_dtype``); the logits projection as int8 rows against bfloat16 and the
engine's dense copy. Where ``kernels.cpu_native`` runs, its Q4_1 / Q8_0 kernels (``native_us``) and
the dense product beside them (``native_dense_us``: the activations rounded as the kernel rounds them,
a float32 GEMM over the blocks' exact dequantization) set ``NATIVE_DENSE_*FROM_ROWS``; where its AVX-512
VNNI kernel runs, that too (``vnni_us``: what the engine then takes at every row count). The
crossovers set ``kernels.cpu_quant``'s ``*DENSE_FROM_ROWS`` and
``*DENSE_LOGITS_FROM_ROWS`` (per dense dtype). Random weights (the kernels' time does not depend on the values),
medians of timed calls after a warm-up.

    python bench/cpu_linear.py --out bench/results/cpu-linear-<date>.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, write_result  # noqa: E402
from kernels import cpu_native  # noqa: E402
from kernels.cpu_quant import (dense_dtype, dense_from_rows, dense_linear, dense_logits_from_rows,  # noqa: E402
                               linear_q8, native_bfloat16_gemm, pack_q4, pack_q8_rows, q4_matmul)

SHAPES = {"gate_up [3072, 576]": (3072, 576), "down [576, 1536]": (576, 1536), "qkv [960, 576]": (960, 576),
          "o [576, 576]": (576, 576)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 256)


def timed(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--out", default=f"bench/results/cpu-linear-{datetime.date.today()}.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    native, native_why = cpu_native.status()
    rows_out = {}
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 16, (n, k))
        scale, minimum = torch.rand(n, k // 32) * 0.01, -torch.rand(n, k // 32) * 0.05
        q4 = pack_q4(codes, scale, minimum, dense=True)
        q4n = pack_q4(codes, scale, minimum, dense=True, native=True) if native else None
        dense, f32 = q4.dense.to(torch.bfloat16), q4.dense.float()
        if q4n is not None:  # the AVX2 kernel's blocks (no VNNI layout) and their exact float32
            avx2 = dataclasses.replace(q4n.native, vnni=None)
            exact = cpu_native.dequantize(avx2)
        table = []
        for m in ROWS:
            x = torch.randn(m, k)
            xb = x.to(torch.bfloat16)
            entry = {"rows": m,
                     "int4_us": round(timed(lambda: torch._weight_int4pack_mm_for_cpu(xb, q4.packed, 32, q4.scales_zeros), args.calls), 1),
                     "bf16_us": round(timed(lambda: F.linear(xb, dense), args.calls), 1),
                     "fp32_us": round(timed(lambda: F.linear(x, f32), args.calls), 1),
                     "dense_us": round(timed(lambda: q4_matmul(x, q4, dense=True), args.calls), 1)}
            if q4n is not None:
                entry["native_us"] = round(timed(lambda: cpu_native.matmul(x, avx2), args.calls), 1)
                entry["native_dense_us"] = round(timed(
                    lambda: F.linear(cpu_native.round_activations(x), exact), args.calls), 1)
                entry["native_weight_gb_s"] = round(avx2.nbytes / entry["native_us"] / 1e3, 2)
                if q4n.native.vnni is not None:
                    entry["vnni_us"] = round(timed(lambda: cpu_native.matmul(x, q4n.native), args.calls), 1)
                    entry["vnni_weight_gb_s"] = round(q4n.native.nbytes / entry["vnni_us"] / 1e3, 2)
            table.append(entry)
        rows_out[name] = table
        print(name, table, flush=True)
    w = torch.randn(49152, 576)
    q8 = pack_q8_rows(w, dense=True)
    plain = pack_q8_rows(w)
    q8n = pack_q8_rows(w, dense=True, native=True) if native else None
    if q8n is not None:
        avx2_q8 = dataclasses.replace(q8n.native, vnni=None)
        exact_q8 = cpu_native.dequantize(avx2_q8)
    logits = []
    bf16_logits = q8.dense.to(torch.bfloat16)
    for m in (1, 4, 8, 16, 32, 64, 128):
        x = torch.randn(m, 576)
        entry = {"rows": m, "int8_us": round(timed(lambda: linear_q8(x, plain), 8), 1),
                 "bf16_us": round(timed(lambda: F.linear(x.to(torch.bfloat16), bf16_logits), 8), 1),
                 "dense_us": round(timed(lambda: dense_linear(x, q8.dense), 8), 1)}
        if q8n is not None:
            entry["native_us"] = round(timed(lambda: cpu_native.matmul(x, avx2_q8), 8), 1)
            entry["native_dense_us"] = round(timed(
                lambda: F.linear(cpu_native.round_activations(x), exact_q8), 8), 1)
            entry["native_weight_gb_s"] = round(avx2_q8.nbytes / entry["native_us"] / 1e3, 2)
            if q8n.native.vnni is not None:
                entry["vnni_us"] = round(timed(lambda: cpu_native.matmul(x, q8n.native), 8), 1)
                entry["vnni_weight_gb_s"] = round(q8n.native.nbytes / entry["vnni_us"] / 1e3, 2)
        logits.append(entry)
    print("logits [49152, 576]", logits, flush=True)
    write_result(args.out, {"benchmark": "cpu_linear", "environment": environment(), "projections": rows_out,
                            "logits": logits, "dense_from_rows": dense_from_rows(),
                            "dense_logits_from_rows": dense_logits_from_rows(),
                            "native": {"available": native, "why": native_why,
                                       "vnni": cpu_native.vnni_status()[0], "vnni_why": cpu_native.vnni_status()[1],
                                       "dense_from_rows": dense_from_rows(True),
                                       "dense_logits_from_rows": dense_logits_from_rows(True)},
                            "native_bfloat16_gemm": native_bfloat16_gemm(),
                            "dense_dtype": str(dense_dtype()).removeprefix("torch."),
                            "anchor": "the int4 / int8 weight-only kernels at the same rows, same run"})


if __name__ == "__main__":
    main()
