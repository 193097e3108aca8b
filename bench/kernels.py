"""Kernel benchmarks on one CUDA GPU, each next to its anchor measured in the same run:

(d) anchors: device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate;
(a) paged decode attention, B=64, context 4096, 32 q / 8 kv heads, d=128, bf16, vs torch SDPA on
    contiguous KV (effective TB/s over the KV bytes for both), with a split-count sweep;
(b) causal prefill attention S=8192, 32 heads, d=128 vs torch SDPA (TFLOP/s);
(c) fused MoE decode, 256 experts, top-6, hidden 4096, intermediate 2048, bf16 / MXFP4 / FP8 /
    NVFP4 weights, batch 1..256: time eager and under a CUDA graph, vs the HBM roofline over the
    expert bytes touched (at the copy bandwidth above) and vs the torch reference;
(e) small ops (RMSNorm, rotary, SwiGLU, top-k/top-p) vs their torch references.
Timings are medians of ``triton.testing.do_bench`` (L2 flushed between runs) on random data, never
zeros; MoE rotates routings so repeated calls do not hit the same experts in L2. Every kernel is
checked against its reference first (``max_rel_err``). Each section records its own error, so one
failure keeps the rest. About three minutes on an H200.

    python3 bench/kernels.py --out bench/results/kernels-h200-<date>.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment  # noqa: E402
from kernels.attention import PagedAttentionMetadata  # noqa: E402
from kernels.moe import fused_moe_ref  # noqa: E402
from kernels.quant import QuantizedWeight, dequantize  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16


def bench_ms(fn: Callable[[], Any], graph: bool = False) -> float:
    if graph:
        return float(do_bench_cudagraph(fn, rep=50, return_mode="median"))
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def anchors(n: int = 1 << 30, mm: int = 8192) -> dict[str, Any]:
    """Copy of ``n`` bf16 elements (default 2 GiB read + 2 GiB written); ``mm``-cubed matmul."""
    src = torch.randn(n, device=DEV, dtype=BF16)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    del src, dst
    a, b = (torch.randn(mm, mm, device=DEV, dtype=BF16) for _ in range(2))
    mm_ms = bench_ms(lambda: a @ b)
    return {"copy_bytes": 2 * 2 * n, "copy_ms": copy_ms, "copy_tb_s": 4 * n / copy_ms / 1e9,
            "matmul_shape": [mm, mm, mm], "matmul_ms": mm_ms,
            "matmul_tflop_s": 2 * mm ** 3 / mm_ms / 1e9}


def paged_cache(num_seqs: int, seq_len: int, num_kv_heads: int, head_dim: int, page: int = 16
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A two-layer ``[blocks, layers, 2, page, Hkv, D]`` storage (layer 0's K/V are the strided
    views the engine uses) and shuffled block tables."""
    blocks_per_seq = seq_len // page
    num_blocks = num_seqs * blocks_per_seq
    storage = torch.randn(num_blocks, 2, 2, page, num_kv_heads, head_dim, device=DEV, dtype=BF16)
    tables = torch.randperm(num_blocks, device=DEV).view(num_seqs, blocks_per_seq).to(torch.int32)
    return storage[:, 0, 0], storage[:, 0, 1], tables, storage


def contiguous_kv(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, S, D]`` copy of each sequence's paged KV, for the SDPA anchor."""
    return cache[tables.long()].flatten(1, 2).transpose(1, 2).contiguous()


def decode_attention(copy_tb_s: float | None, b: int = 64, ctx: int = 4096, hq: int = 32,
                     hkv: int = 8, d: int = 128) -> dict[str, Any]:
    from kernels.triton_attention_decode import (GPU_CONFIG, decode_num_splits,
                                                 paged_decode_attention)
    k_cache, v_cache, tables, _ = paged_cache(b, ctx, hkv, d)
    q = torch.randn(b, hq, d, device=DEV, dtype=BF16)
    seq_lens = torch.full((b,), ctx, device=DEV, dtype=torch.int32)
    scale = d ** -0.5
    k, v = contiguous_kv(k_cache, tables), contiguous_kv(v_cache, tables)
    kv_bytes = 2 * b * ctx * hkv * d * 2
    sdpa = lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)
    try:
        ref = sdpa()[:, :, 0]
        gqa = "enable_gqa"
    except RuntimeError:  # no GQA in this SDPA backend: give it repeated heads (reads more bytes)
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        sdpa = lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale)
        ref = sdpa()[:, :, 0]
        gqa = "repeat_interleave"
    out: dict[str, Any] = {"shape": dict(batch=b, context=ctx, q_heads=hq, kv_heads=hkv, head_dim=d,
                                         page=16), "kv_bytes": kv_bytes}
    default = decode_num_splits(b, hkv, ctx, q.device)
    sweep = {}
    for splits in sorted({default, 1, 2, 4, 8, 16}):
        run = lambda s=splits: paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, ctx,
                                                      scale, num_splits=s)
        err = rel_err(run(), ref)
        ms = bench_ms(run)
        sweep[splits] = {"ms": ms, "tb_s": kv_bytes / ms / 1e9, "max_rel_err": err}
    sdpa_ms = bench_ms(sdpa)
    best = min(sweep, key=lambda s: sweep[s]["ms"])
    out.update(default_splits=default, best_splits=best, splits=sweep,
               triton_ms=sweep[default]["ms"], triton_tb_s=sweep[default]["tb_s"],
               sdpa_ms=sdpa_ms, sdpa_tb_s=kv_bytes / sdpa_ms / 1e9, sdpa_gqa=gqa,
               speedup_vs_sdpa=sdpa_ms / sweep[default]["ms"],
               config=dict(GPU_CONFIG))
    if copy_tb_s:
        out["fraction_of_copy_bw"] = out["triton_tb_s"] / copy_tb_s
    return out


def prefill_attention(s: int = 8192, hq: int = 32, d: int = 128,
                      kv_heads: tuple[int, ...] = (32, 8)) -> dict[str, Any]:
    from kernels.triton_attention import paged_attention_triton
    from kernels.triton_attention_prefill import _prefill_kernel
    results: dict[str, Any] = {}
    for hkv in kv_heads:
        k_cache, v_cache, tables, _ = paged_cache(1, s, hkv, d)
        q = torch.randn(s, hq, d, device=DEV, dtype=BF16)
        meta = PagedAttentionMetadata(
            query_start_loc=torch.tensor([0, s], device=DEV, dtype=torch.int32),
            seq_lens=torch.tensor([s], device=DEV, dtype=torch.int32), block_tables=tables,
            slot_mapping=torch.arange(s, device=DEV), query_start_loc_cpu=[0, s],
            seq_lens_cpu=[s], max_query_len=s, max_seq_len=s)
        k, v = contiguous_kv(k_cache, tables), contiguous_kv(v_cache, tables)
        qt = q.transpose(0, 1)[None]  # [1, Hq, S, D]
        sdpa = lambda: F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=d ** -0.5,
                                                      enable_gqa=hkv != hq)
        run = lambda: paged_attention_triton(q, k_cache, v_cache, meta, d ** -0.5)
        err = rel_err(run(), sdpa()[0].transpose(0, 1))
        flops = 2 * 2 * s * s * d * hq / 2  # causal: half of QK^T and PV
        t_ms, s_ms = bench_ms(run), bench_ms(sdpa)
        results[f"kv_heads_{hkv}"] = {
            "shape": dict(seq=s, q_heads=hq, kv_heads=hkv, head_dim=d, page=16),
            "triton_ms": t_ms, "triton_tflop_s": flops / t_ms / 1e9, "sdpa_ms": s_ms,
            "sdpa_tflop_s": flops / s_ms / 1e9, "ratio_vs_sdpa": s_ms / t_ms, "max_rel_err": err,
            "autotuned": str(_prefill_kernel.best_config)}
        del k_cache, v_cache, k, v
    return results


def random_moe_weight(fmt: str, e: int, n: int, k: int) -> QuantizedWeight:
    """Random weights in ``fmt`` made directly in the stored layout (no quantization pass):
    bandwidth-realistic, never zeros, no NaN encodings, modest scales."""
    def rand_bytes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, device=DEV, dtype=torch.uint8)
    if fmt == "bf16":
        return QuantizedWeight("bf16", torch.randn(e, n, k, device=DEV, dtype=BF16) / k ** 0.5)
    if fmt == "fp8_block":
        data = rand_bytes(e, n, k)
        data[(data & 0x7F) == 0x7F] = 0x30  # no NaN codes
        scale = torch.rand(e, math.ceil(n / 128), math.ceil(k / 128), device=DEV) * 1e-3 + 1e-3
        return QuantizedWeight("fp8_block", data.view(torch.float8_e4m3fn), scale)
    group = 32 if fmt == "mxfp4" else 16
    data = rand_bytes(e, n, k // 2)
    if fmt == "mxfp4":
        scale = torch.randint(118, 123, (e, n, k // group), device=DEV, dtype=torch.uint8)
        return QuantizedWeight("mxfp4", data, scale)
    scale = (torch.rand(e, n, k // group, device=DEV) * 4 + 1).to(torch.float8_e4m3fn)
    return QuantizedWeight("nvfp4", data, scale, torch.rand(e, device=DEV) * 1e-3 + 1e-3)


def expert_bytes(w: QuantizedWeight) -> int:
    per = w.data[0].numel() * w.data.element_size()
    if w.scale is not None:
        per += w.scale[0].numel() * w.scale.element_size()
    return per


def moe_decode(copy_tb_s: float | None, formats: list[str], batches: list[int], deadline: float,
               e: int = 256, top_k: int = 6, hidden: int = 4096, inter: int = 2048,
               rotations: int = 8) -> dict[str, Any]:
    from kernels.triton_moe import _w2_kernel, _w13_swiglu_kernel, fused_moe_triton
    results: dict[str, Any] = {"shape": dict(experts=e, top_k=top_k, hidden=hidden,
                                             intermediate=inter), "formats": {}}
    for fmt in formats:
        if time.monotonic() > deadline:
            results["formats"][fmt] = {"skipped": "time budget spent"}
            continue
        w13, w2 = random_moe_weight(fmt, e, 2 * inter, hidden), random_moe_weight(fmt, e, hidden, inter)
        per_expert = expert_bytes(w13) + expert_bytes(w2)
        rows: dict[str, Any] = {}
        for t in batches:
            x = torch.randn(t, hidden, device=DEV, dtype=BF16)
            picks = [torch.rand(t, e, device=DEV).topk(top_k, dim=-1) for _ in range(rotations)]
            routings = [(p.values.softmax(-1), p.indices) for p in picks]
            touched = sum(int(ids.unique().numel()) for _, ids in routings) / rotations * per_expert
            run_all = lambda: [fused_moe_triton(x, w13, w2, wt, ids) for wt, ids in routings]
            row: dict[str, Any] = {"bytes_touched": touched}
            if t <= 4:
                wt, ids = routings[0]
                row["max_rel_err"] = rel_err(fused_moe_triton(x, w13, w2, wt, ids),
                                             fused_moe_ref(x, w13, w2, wt, ids))
            row["eager_ms"] = bench_ms(run_all) / rotations
            row["graph_ms"] = bench_ms(run_all, graph=True) / rotations
            if copy_tb_s:
                roofline_ms = touched / (copy_tb_s * 1e9)
                row["roofline_ms"] = roofline_ms
                row["fraction_of_roofline_graph"] = roofline_ms / row["graph_ms"]
                row["fraction_of_roofline_eager"] = roofline_ms / row["eager_ms"]
            if fmt in ("bf16", "mxfp4") and t in (1, 8, 64):
                wt, ids = routings[0]
                row["torch_ref_ms"] = bench_ms(lambda: fused_moe_ref(x, w13, w2, wt, ids))
                row["speedup_vs_torch_ref"] = row["torch_ref_ms"] / row["eager_ms"]
            rows[str(t)] = row
        rows["autotuned"] = {"w13": str(_w13_swiglu_kernel.best_config),
                             "w2": str(_w2_kernel.best_config)}
        results["formats"][fmt] = rows
        del w13, w2
        torch.cuda.empty_cache()
    return results


def small_ops(n: int = 4096, vocab: int = 151936, rows: int = 64, inter: int = 14336
              ) -> dict[str, Any]:
    from kernels.activation import silu_and_mul_ref
    from kernels.norm import rms_norm_ref
    from kernels.rotary import apply_rotary_ref, rope_cos_sin, rope_inv_freq
    from kernels.sampling import apply_top_k_top_p_min_p_ref
    from kernels.triton_activation import silu_and_mul_triton
    from kernels.triton_norm import rms_norm_triton
    from kernels.triton_rotary import apply_rotary_triton
    from kernels.triton_sampling import apply_top_k_top_p_min_p_triton
    x, res = (torch.randn(n, n, device=DEV, dtype=BF16) for _ in range(2))
    w = torch.randn(n, device=DEV, dtype=BF16)
    q = torch.randn(n, 32, 128, device=DEV, dtype=BF16)
    cos, sin = rope_cos_sin(rope_inv_freq(128, 5e5), torch.arange(n, device=DEV))
    h = torch.randn(n, 2 * inter, device=DEV, dtype=BF16)
    logits = 4 * torch.randn(rows, vocab, device=DEV)
    top_k = torch.randint(1, 100, (rows,), device=DEV)
    top_p = torch.rand(rows, device=DEV) * 0.5 + 0.4
    cases = {
        f"rms_norm_residual_{n}x{n}": (lambda: rms_norm_triton(x, w, 1e-6, res)[0],
                                        lambda: rms_norm_ref(x, w, 1e-6, res)[0]),
        f"rotary_{n}x32x128": (lambda: apply_rotary_triton(q, cos, sin), lambda: apply_rotary_ref(q, cos, sin)),
        f"silu_and_mul_{n}x{inter}": (lambda: silu_and_mul_triton(h, 10.0), lambda: silu_and_mul_ref(h, 10.0)),
        f"top_k_top_p_{rows}x{vocab}": (lambda: apply_top_k_top_p_min_p_triton(logits, top_k, top_p, None),
                                  lambda: apply_top_k_top_p_min_p_ref(logits, top_k, top_p, None)),
    }
    out = {}
    for name, (fast, ref) in cases.items():
        a, b = fast(), ref()
        err = (float((a.isinf() != b.isinf()).float().mean()) if name.startswith("top") else rel_err(a, b))
        t_ms, r_ms = bench_ms(fast), bench_ms(ref)
        out[name] = {"triton_ms": t_ms, "torch_ms": r_ms, "speedup": r_ms / t_ms, "err": err}
    return out


def run_section(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    start = time.monotonic()
    try:
        results[name] = fn()
    except Exception:  # keep every other section's figures
        results[name] = {"error": traceback.format_exc(limit=8)}
    results.setdefault("seconds", {})[name] = round(time.monotonic() - start, 1)
    print(f"[{name}] {results['seconds'][name]} s", flush=True)
    return results[name]


def summary(r: dict[str, Any]) -> list[str]:
    lines = [f"{r['env'].get('device')} torch {r['env'].get('torch')} triton {r['env'].get('triton')}"]
    a = r.get("anchors", {})
    if "copy_tb_s" in a:
        lines.append(f"anchors      copy {a['copy_tb_s']:.2f} TB/s   bf16 matmul {a['matmul_tflop_s']:.0f} TFLOP/s")
    d = r.get("decode_attention", {})
    if "triton_tb_s" in d:
        lines.append(f"decode attn  triton {d['triton_tb_s']:.2f} TB/s ({d['default_splits']} splits; best "
                     f"{d['best_splits']}: {d['splits'][d['best_splits']]['tb_s']:.2f})   sdpa {d['sdpa_tb_s']:.2f} TB/s"
                     f"   x{d['speedup_vs_sdpa']:.2f}")
    for key, p in r.get("prefill_attention", {}).items():
        if isinstance(p, dict) and "triton_tflop_s" in p:
            lines.append(f"prefill {key:<10} triton {p['triton_tflop_s']:.0f} TFLOP/s  sdpa {p['sdpa_tflop_s']:.0f}"
                         f"  ratio {p['ratio_vs_sdpa']:.2f}  err {p['max_rel_err']:.1e}")
    for fmt, rows in r.get("moe_decode", {}).get("formats", {}).items():
        cells = [f"{t}:{row['fraction_of_roofline_graph']:.0%}" for t, row in rows.items()
                 if isinstance(row, dict) and "fraction_of_roofline_graph" in row]
        lines.append(f"moe {fmt:<9} roofline (graph)  " + " ".join(cells))
    for name, s in r.items():
        if isinstance(s, dict) and "error" in s:
            lines.append(f"ERROR in {name}: {s['error'].strip().splitlines()[-1]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--formats", default="bf16,mxfp4,fp8_block,nvfp4")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--budget-s", type=float, default=210.0, help="skip MoE formats past this")
    parser.add_argument("--sections", default="decode_attention,prefill_attention,moe_decode,small_ops",
                        help="which sections to run (the anchors always run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU")
    start = time.monotonic()
    from kernels.triton_support import PORTABLE_DECODE
    results: dict[str, Any] = {"env": dict(environment(), triton=triton.__version__,
                                           cuda=torch.version.cuda,
                                           portable_decode=PORTABLE_DECODE)}
    anchor = run_section(results, "anchors", anchors)
    copy_tb_s = anchor.get("copy_tb_s")
    sections = {
        "decode_attention": lambda: decode_attention(copy_tb_s),
        "prefill_attention": prefill_attention,
        "moe_decode": lambda: moe_decode(copy_tb_s, args.formats.split(","),
                                         [int(b) for b in args.batches.split(",")], start + args.budget_s),
        "small_ops": small_ops,
    }
    chosen = args.sections.split(",")
    unknown = [name for name in chosen if name not in sections]
    if unknown:
        sys.exit(f"unknown sections {unknown}; choose from {sorted(sections)}")
    results["sections"] = chosen
    for name in chosen:
        run_section(results, name, sections[name])
    results["total_s"] = round(time.monotonic() - start, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print("\n".join(summary(results)))
    print(f"wrote {args.out} ({results['total_s']} s)")


if __name__ == "__main__":
    main()
