"""Compile every Triton kernel for sm_90 and sm_120 at real shapes, without a GPU, and print one
JSON line per (kernel, arch): shared memory per block, or the compile error. The decode-shaped
MoE kernels are also built for sm_89 (hardware fp8 decode) and, for MXFP4, sm_80.

Run as a script in a process without ``TRITON_INTERPRET`` (test_portability.py does), or by hand:
``python -m tests.kernels.portability_check``. Arguments are ``meta`` tensors: only dtypes and
alignment matter. An autotuned kernel is compiled on sm_120 with every config its autotuner would
try there (pruned against sm_120's 99 KB, as on that device), on sm_90 with the smallest and the
largest."""
from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tests.kernels.aot import SM120_SHARED_LIMIT, compile_for

ARCHS = [(9, 0), (12, 0)]


def _t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _cases() -> Iterator[tuple[str, Any, tuple[Any, ...], dict[str, Any]]]:
    from kernels import (triton_activation, triton_attention, triton_attention_decode,
                         triton_attention_prefill, triton_moe, triton_moe_align, triton_norm,
                         triton_rotary, triton_sampling)
    i32, f32, u8 = torch.int32, torch.float32, torch.uint8
    q, cache = _t(64, 32, 128), _t(4096, 16, 8, 128)
    table, lens, part = _t(64, 300, dtype=i32), _t(64, dtype=i32), _t(64, 32, 8, 128, dtype=f32)
    strides = (2048 * 16, 256, 16) * 2
    yield ("decode", triton_attention_decode._decode_split_kernel,
           (q, cache, cache, table, lens, q, part, part, lens, 4096, 128, *strides, 300, 4096, 128, 0.1, 0),
           dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, GQA=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16,
                NUM_SPLITS=8, HAS_WINDOW=False, UPCAST=False, **triton_attention_decode.GPU_CONFIG))
    yield ("prefill", triton_attention_prefill._prefill_kernel,
           (q, cache, cache, q, _t(65, dtype=i32), lens, table, 4096, 128, *strides, 300, 4096,
            128, 0.1, 0, 4096),
           dict(GQA=4, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, HAS_WINDOW=True, UPCAST=False))
    yield ("write_kv", triton_attention._write_kv_kernel,
           (q, q, cache, cache, _t(64, dtype=torch.int64), 1024, 128, 1024, 128, *strides),
           dict(NUM_KV_HEADS=8, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=8, BLOCK_D=128, num_warps=4))
    from kernels import triton_block_copy, triton_qkv_prepare
    rows = _t(2305, 294912, dtype=torch.int64)
    yield ("block_copy", triton_block_copy._copy_blocks_kernel,
           (rows, rows, _t(64, dtype=torch.int64), _t(64, dtype=torch.int64), 294912),
           dict(CHUNK=4096, num_warps=8))
    qkv, cs = _t(64, 6144), _t(64, 64, dtype=f32)
    yield ("qkv_prepare", triton_qkv_prepare._qkv_prepare_kernel,
           (qkv, cs, cs, _t(128), _t(128), q, cache, cache, _t(64, dtype=torch.int64), 6144, 64, 64, 4096, 128,
            *strides, 1e-6),
           dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_D=128, HALF=64, PAGE_SIZE=16,
                HAS_NORM=True, INTERLEAVED=False, num_warps=1))
    x = _t(512, 4096)
    yield ("rms_norm", triton_norm._rms_norm_kernel, (x, x, _t(4096), x, x, 4096, 4096, 4096,
                                                      4096, 4096, 1e-6),
           dict(HAS_RESIDUAL=True, BLOCK=4096, num_warps=16))
    yield ("rotary", triton_rotary._rotary_kernel,
           (q, _t(64, 64, dtype=f32), _t(64, 64, dtype=f32), q, 4096, 128, 4096, 128, 64, 64, 32,
            128), dict(HALF=32, BLOCK_HALF=32, BLOCK_H=32, INTERLEAVED=True, HAS_REST=True,
                       BLOCK_REST=64, num_warps=4))
    yield ("silu_and_mul", triton_activation._silu_and_mul_kernel,
           (x, x, 4096, 2048, 2048, 10.0), dict(HAS_CLAMP=True, BLOCK=2048, num_warps=4))
    logits = _t(64, 151936, dtype=f32)
    yield ("sampling", triton_sampling._filter_kernel,
           (logits, logits, _t(64, dtype=i32), _t(64, dtype=f32), _t(64, dtype=f32), 151936,
            151936, 151936), dict(HAS_TOP_K=True, HAS_TOP_P=True, HAS_MIN_P=True, BLOCK=4096,
                                  num_warps=8))
    from kernels import triton_spec_decode
    i64 = torch.int64
    inputs, base, live, rows = _t(64, 4, dtype=i64), _t(64, dtype=i64), _t(64, dtype=torch.bool), _t(256, dtype=i64)
    spec_table, dest = _t(64, 300, dtype=i32), _t(256, 512, dtype=i32)
    yield ("spec_verify_rows", triton_spec_decode._verify_rows_kernel,
           (inputs, base, live, spec_table, rows, rows, _t(256, dtype=i32), rows, dest, 64, 4, 300, 512, 300, 512, 16),
           dict(HAS_LIVE=True, BLOCK_W=triton_spec_decode.BLOCK_W, num_warps=1))
    chain = _t(2, 64, dtype=i64)
    yield ("spec_accept_draft_rows", triton_spec_decode._accept_draft_kernel,
           (inputs, inputs, base, live, spec_table, base, base, rows, rows, _t(256, dtype=i32), rows, base, chain,
            _t(2, 64, dtype=i32), chain, _t(64, 512, dtype=i32), 64, 4, 300, 512, 300, 64, 512, 16),
           dict(HAS_LIVE=True, BLOCK_R=4, BLOCK_W=triton_spec_decode.BLOCK_W, num_warps=1))
    ids = _t(4096, dtype=i32)
    x = _t(64, 4096)
    yield ("moe_align", triton_moe_align._align_kernel,
           (ids, ids, ids, ids, ids, 384, 280, x, x, 4096, 4096),
           dict(NUM_EXPERTS=256, BLOCK_E=256, BLOCK_P=64, BLOCK_M=16, BLOCK_H=2048, num_warps=8))
    from kernels import triton_linear
    w, xl = _t(24576, 4096), _t(32, 4096)
    for rows, gated in ((1, False), (32, True)):  # a decode row; a batch of 32 through gate/up
        yield (f"linear_m{rows}{'_gated' if gated else ''}", triton_linear._autotuned,
               (xl, w, w, xl, rows, 12288, 4096, 4096, 4096, 12288),
               dict(HAS_BIAS=False, GATED=gated, UPCAST=False, BLOCK_M=triton_linear.block_m(rows)))
    yield from _moe_cases(triton_moe)


def _moe_cases(triton_moe: Any) -> Iterator[tuple[str, Any, tuple[Any, ...], dict[str, Any]]]:
    hidden, inter, experts = 4096, 2048, 256
    ids, g, route = _t(8192, dtype=torch.int32), _t(experts, dtype=torch.float32), _t(384, dtype=torch.float32)
    act, x, partial = _t(384, inter), _t(64, hidden), _t(384, hidden, dtype=torch.float32)
    for fmt, code in (("bf16", 0), ("fp8_block", 1), ("mxfp4", 2), ("nvfp4", 3)):
        packed = 2 if fmt in ("mxfp4", "nvfp4") else 1
        dtype = torch.bfloat16 if fmt == "bf16" else torch.uint8
        w13, w2 = _t(experts, 2 * inter, hidden // packed, dtype=dtype), _t(experts, hidden, inter // packed, dtype=dtype)
        group = {"fp8_block": 128, "mxfp4": 32, "nvfp4": 16}.get(fmt, 1)
        if fmt == "fp8_block":
            s13, s2 = _t(experts, 32, 32, dtype=torch.float32), _t(experts, 32, 16, dtype=torch.float32)
        elif fmt == "bf16":
            s13, s2 = w13, w2
        else:
            s13, s2 = _t(experts, 2 * inter, hidden // group, dtype=torch.uint8), _t(experts, hidden, inter // group, dtype=torch.uint8)
        for block_m in (16, 32, 64):  # every BLOCK_M the kernel picks (triton_moe._block_m)
            common = dict(FMT=code, SCALE_UE8M0=False, UPCAST=False, FAST=code != 0, F32_DOT=False,
                          BLOCK_M=block_m, EVEN_K=True)
            archs = ARCHS
            if block_m == 16 and code:
                archs = ARCHS + [(8, 9)] + ([(8, 0)] if fmt == "mxfp4" else [])
            common["archs"] = archs
            yield (f"moe_w13_{fmt}_m{block_m}", triton_moe._w13_swiglu_kernel,
                   (x, w13, s13, g, act, ids, ids, ids, inter, hidden, 384, 6, hidden, w13.stride(0),
                    w13.stride(1), s13.stride(0), s13.stride(1), 1, inter, 7.0, 16),
                   dict(common, HAS_CLAMP=True, PAIRED_OUT=code >= 2))
            yield (f"moe_w2_{fmt}_m{block_m}", triton_moe._w2_kernel,
                   (act, w2, s2, g, partial, ids, ids, ids, route, hidden, inter, 384, inter, w2.stride(0),
                    w2.stride(1), s2.stride(0), s2.stride(1), 1, hidden, 16), common)
            if block_m == 16 and code >= 2:  # float32 / float16 activations: portable decode, float32 dot
                f32 = dict(common, FAST=False, F32_DOT=True, archs=ARCHS)
                yield (f"moe_w13_{fmt}_m{block_m}_f32", triton_moe._w13_swiglu_kernel,
                       (x, w13, s13, g, act, ids, ids, ids, inter, hidden, 384, 6, hidden, w13.stride(0),
                        w13.stride(1), s13.stride(0), s13.stride(1), 1, inter, 7.0, 16),
                       dict(f32, HAS_CLAMP=True, PAIRED_OUT=True))
                yield (f"moe_w2_{fmt}_m{block_m}_f32", triton_moe._w2_kernel,
                       (act, w2, s2, g, partial, ids, ids, ids, route, hidden, inter, 384, inter, w2.stride(0),
                        w2.stride(1), s2.stride(0), s2.stride(1), 1, hidden, 16), f32)
    yield ("moe_sum_top_k", triton_moe._sum_top_k_kernel, (partial, x, hidden),
           dict(TOP_K=6, BLOCK=1024, num_warps=4))


@contextlib.contextmanager
def _device_shared_memory(arch: tuple[int, int]) -> Iterator[None]:
    """Kernel modules that prune configs by the device's shared memory see ``arch``'s."""
    from kernels import triton_deepseek_v4_attention, triton_linear, triton_moe
    limit = SM120_SHARED_LIMIT if arch == (12, 0) else 227 * 1024
    saved = [(m, m.shared_memory_per_block) for m in (triton_linear, triton_moe, triton_deepseek_v4_attention)]
    for module, _ in saved:
        module.shared_memory_per_block = lambda: limit  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, original in saved:
            module.shared_memory_per_block = original  # type: ignore[attr-defined]


def _configs(kernel: Any, kwargs: dict[str, Any], arch: tuple[int, int]) -> list[dict[str, Any]]:
    """Launch options to try: none for plain kernels; for autotuned ones the configs surviving the
    kernel's own pruning for ``arch``: all of them on sm_120, the smallest and largest elsewhere."""
    configs = getattr(kernel, "configs", None)
    if configs is None:
        return [{}]
    prune: Callable[..., Any] | None = getattr(kernel, "early_config_prune", None)
    if prune is not None:
        with _device_shared_memory(arch):
            configs = prune(configs, {}, **kwargs)
    opts = [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in configs]
    size = lambda o: o.get("num_stages", 1) * sum(v for k, v in o.items() if k.startswith("BLOCK"))
    opts.sort(key=size)
    if arch == (12, 0):
        return opts
    return [opts[0], opts[-1]] if len(opts) > 1 else opts


def main() -> None:
    only = set(sys.argv[1:])
    for name, kernel, args, kwargs in _cases():
        if only and name not in only:
            continue
        archs = kwargs.pop("archs", ARCHS)
        for arch in archs:
            for opts in _configs(kernel, kwargs, arch):
                record: dict[str, Any] = {"kernel": name, "arch": f"sm_{arch[0]}{arch[1]}",
                                          "config": opts}
                try:
                    compiled = compile_for(kernel, arch, *args, **kwargs, **opts)
                    record["shared"] = compiled.metadata.shared
                except Exception as e:  # report every failure, keep compiling the rest
                    record["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
