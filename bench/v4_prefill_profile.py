"""Where a DeepSeek-V4 prefill's GPU time goes at V4-Flash width, and how the prefill kernels'
tiles fare (issue 17's prefill row).

Model and prompt as ``bench/deepseek_v4_layers.py``'s prefill: four layers (sliding, CSA, HCA, CSA),
random weights, MXFP4 routed experts, one prompt of ``--tokens``. One forward captures each
layer's attention and MoE inputs, and the arguments its sparse attention, indexer and fused MoE
were called with. Then:

  parts    each layer, its attention and its MoE called alone on its inputs (median ms, as the layers
           bench times them), under ``torch.profiler``: GPU time per call by kernel name, and
           by class (our Triton kernels by name, ``bench.v4_decode_profile.TRITON_KERNEL_CLASSES``;
           cuBLAS / CUTLASS GEMMs ``gemm``; the rest ``other``).
  sweep    the prefill's Triton kernels called alone on the captured arguments, one tile
           config at a time (the kernel's own list, then candidates it lacks, ``in_list`` says
           which): the first CSA layer's sparse attention and indexer scores, the first
           sliding layer's attention, and the fused MoE (its ``w13`` and ``w2`` GEMMs in turn,
           at the expert block of rows the kernel picks and at 128). A config that does not
           fit the GPU is recorded with its error. The fastest config's median against the
           autotuned kernel's (``speedup``).

Medians of ``triton.testing.do_bench`` (L2 flushed); a wall clock on CPU, where ``--tiny`` runs
toy widths through the Triton interpreter (set ``TRITON_INTERPRET=1``) as a plumbing check (two
sweeps, two configs each).

    python3 bench/v4_prefill_profile.py --out bench/results/v4-prefill-profile-h200-<date>.json
    TRITON_INTERPRET=1 python3 bench/v4_prefill_profile.py --tiny --out /tmp/p.json
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.environ.get("TRITON_INTERPRET") == "1":
    import tests.conftest  # noqa: E402,F401  (the interpreter's scalar-index patch the kernel tests use)

from bench.common import environment, write_result  # noqa: E402
from bench.decode_profile import kernel_times  # noqa: E402
from bench.deepseek_v4_layers import (LAYERS, Capture, blocks, build_model, device_and_widths,  # noqa: E402
                                      make_context, timer)
from bench.v4_decode_profile import TRITON_KERNEL_CLASSES  # noqa: E402
from cluster.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402
from cluster.models.deepseek_v4_config import CSA, SLIDING  # noqa: E402
from kernels import triton_deepseek_v4_hc as hc_kernels  # noqa: E402

GEMM_MARKS = ("gemm", "cutlass", "nvjet", "xmma", "cublas")


def kernel_class_of(name: str) -> str:
    if name in TRITON_KERNEL_CLASSES:
        return TRITON_KERNEL_CLASSES[name]
    return "gemm" if any(m in name.lower() for m in GEMM_MARKS) else "other"


# Candidate tiles: (config kwargs, num_warps, num_stages). The kernels' own lists are swept too.
ATTENTION_CANDIDATES = [
    ({"BLOCK_H": 64, "BLOCK_N": 32}, 8, 3),
    ({"BLOCK_H": 64, "BLOCK_N": 64}, 8, 2),
    ({"BLOCK_H": 64, "BLOCK_N": 32}, 4, 2),
    ({"BLOCK_H": 32, "BLOCK_N": 64}, 4, 2),
    ({"BLOCK_H": 64, "BLOCK_N": 32}, 8, 1),
]
INDEXER_CANDIDATES = [({"BLOCK_E": 128}, 4, 3), ({"BLOCK_E": 64}, 4, 4), ({"BLOCK_E": 128}, 8, 3),
                      ({"BLOCK_E": 256}, 8, 2)]
MOE_CANDIDATES = [({"BLOCK_N": 64, "BLOCK_K": 128}, 8, 3), ({"BLOCK_N": 128, "BLOCK_K": 128}, 8, 3),
                  ({"BLOCK_N": 128, "BLOCK_K": 64}, 4, 4), ({"BLOCK_N": 64, "BLOCK_K": 64}, 4, 4),
                  ({"BLOCK_N": 256, "BLOCK_K": 64}, 8, 3), ({"BLOCK_N": 128, "BLOCK_K": 128}, 8, 2),
                  ({"BLOCK_N": 64, "BLOCK_K": 256}, 4, 2)]


class Recorder:
    """The arguments of the first call of a callable attribute, kept (tensors by reference)."""

    def __init__(self, owner: Any, attr: str) -> None:
        self.owner, self.attr, self.fn = owner, attr, getattr(owner, attr)
        self.call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        setattr(owner, attr, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.call is None:
            self.call = (args, kwargs)
        return self.fn(*args, **kwargs)

    def remove(self) -> None:
        setattr(self.owner, self.attr, self.fn)


def _config(kwargs: dict[str, int], warps: int, stages: int) -> Any:
    return triton.Config(dict(kwargs), num_warps=warps, num_stages=stages)


def _describe(config: Any) -> dict[str, Any]:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def sweep(kernel: Any, fn: Callable[[], Any], candidates: list[Any], bench: Callable[[Callable[[], Any]], float],
          limit: int | None = None, min_warps: int = 1) -> dict[str, Any]:
    """``fn`` (which launches the autotuned ``kernel``) timed with each config alone: the kernel's
    list, then ``candidates`` it lacks (those of at least ``min_warps``); and as autotuned."""
    own = list(kernel.configs)
    keys = {str(_describe(c)) for c in own}
    configs = [c for c in own + [c for c in candidates if str(_describe(c)) not in keys] if c.num_warps >= min_warps]
    if limit is not None:
        configs = configs[:limit]
    saved = (kernel.configs, kernel.cache)
    rows = []
    try:
        for c in configs:
            kernel.configs, kernel.cache = [c], {}
            row: dict[str, Any] = {**_describe(c), "in_list": str(_describe(c)) in keys}
            try:
                row["ms"] = bench(fn)
            except Exception as e:  # a tile over the GPU's shared memory or registers
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
    finally:
        kernel.configs, kernel.cache = saved
    tuned = bench(fn)
    timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    best = timed[0] if timed else None
    return {"autotuned_ms": tuned, "autotuned_config": _describe(kernel.best_config) if getattr(
        kernel, "best_config", None) else None, "best": best,
            "speedup": tuned / best["ms"] if best else None, "configs": timed + [r for r in rows if "ms" not in r]}


def profile_part(fn: Callable[[], Any], calls: int, on_gpu: bool) -> dict[str, Any]:
    fn()
    activities = [torch.profiler.ProfilerActivity.CUDA if on_gpu else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if on_gpu:
            torch.cuda.synchronize()
    if on_gpu:
        kernels = kernel_times(prof)
    else:  # plumbing check: each op's own CPU time stands for its kernels
        kernels = collections.defaultdict(lambda: [0.0, 0])
        for ev in prof.events():
            kernels[ev.name][0] += ev.self_cpu_time_total
            kernels[ev.name][1] += 1
    table: list[dict[str, Any]] = sorted(
        ({"kernel": n, "class": kernel_class_of(n), "us_per_call": v[0] / calls, "launches_per_call": v[1] / calls}
         for n, v in kernels.items()), key=lambda r: -r["us_per_call"])
    classes: dict[str, float] = collections.defaultdict(float)
    for r in table:
        classes[r["class"]] += r["us_per_call"]
    return {"kernel_us_per_call": sum(r["us_per_call"] for r in table),
            "launches_per_call": sum(r["launches_per_call"] for r in table),
            "classes": dict(sorted(classes.items(), key=lambda kv: -kv[1])), "kernels": table[:25]}


@torch.no_grad()
def run(model: DeepseekV4ForCausalLM, tokens: int, block_size: int, device: torch.device, tiny: bool,
        checkpoint: Callable[[dict[str, Any]], None] = lambda out: None, sweeps: bool = True) -> dict[str, Any]:
    """The parts and the sweeps; ``checkpoint(partial result)`` after each section."""
    from kernels import triton_deepseek_v4_attention as attention
    from kernels import triton_deepseek_v4_indexer as indexer
    from kernels import triton_moe

    args = model.args
    layers = blocks(model)
    csa = next(i for i, t in enumerate(args.layer_types) if t == CSA)
    sliding = next(i for i, t in enumerate(args.layer_types) if t == SLIDING)
    recorders = {"attention_csa": Recorder(layers[csa].attn, "attention_kernel"),
                 "attention_sliding": Recorder(layers[sliding].attn, "attention_kernel"),
                 "indexer": Recorder(layers[csa].attn.indexer, "select_kernel"),
                 "moe": Recorder(layers[csa].ffn, "moe_kernel")}
    ctx = make_context(model.kv_cache_specs(block_size, "bfloat16"), [tokens], [tokens], device, model.dtype)
    capture = Capture(model)
    model(torch.randint(0, args.vocab_size, (tokens,), device=device), ctx)
    capture.remove()
    for r in recorders.values():
        r.remove()
    bench = timer(device)
    on_gpu = device.type == "cuda"
    out: dict[str, Any] = {"tokens": tokens, "parts": [], "sweeps": {}}
    for i, layer in enumerate(layers):
        for part, captured, module in (("layer", "layer", layer), ("attention", "attn", layer.attn),
                                       ("moe", "ffn", layer.ffn)):
            fn = functools.partial(module, *capture.inputs[(i, captured)])
            row = {"layer": i, "type": args.layer_types[i], "part": part, "ms": bench(fn)}
            row.update(profile_part(fn, 3, on_gpu))
            out["parts"].append(row)
            print(f"[parts] layer {i} {part}: {row['ms']:.3f} ms", file=sys.stderr, flush=True)
    checkpoint(out)

    if not sweeps:
        return out
    limit = 2 if tiny else None
    cands = {name: [_config(*c) for c in lst] for name, lst in (
        ("attention", ATTENTION_CANDIDATES), ("indexer", INDEXER_CANDIDATES), ("moe", MOE_CANDIDATES))}

    def call(name: str, kernel_fn: Callable[..., Any]) -> Callable[[], Any]:
        call = recorders[name].call
        assert call is not None, f"{name} was not called"
        return functools.partial(kernel_fn, *call[0], **call[1])

    jobs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("attention_csa", lambda: sweep(attention._sparse_attention_kernel,
                                        call("attention_csa", attention.sparse_attention_triton),
                                        cands["attention"], bench, limit)),
        ("attention_sliding", lambda: sweep(attention._sparse_attention_kernel,
                                            call("attention_sliding", attention.sparse_attention_triton),
                                            cands["attention"], bench, limit)),
        ("indexer_scores", lambda: sweep(indexer._indexer_scores_kernel,
                                         call("indexer", indexer.indexer_topk_triton), cands["indexer"], bench,
                                         limit)),
    ]
    default_block_m = triton_moe._block_m
    fused = call("moe", triton_moe.fused_moe_triton)

    def fused_at(pick: Callable[[int, int], int]) -> Callable[[], Any]:
        """The fused MoE call with its expert block of rows chosen by ``pick(pairs, experts)``."""
        def fn() -> Any:
            setattr(triton_moe, "_block_m", pick)
            try:
                return fused()
            finally:
                setattr(triton_moe, "_block_m", default_block_m)
        return fn

    # 128-row blocks: the four- and eight-warp tiles only (two warps hold too few of its rows)
    for tag, pick, warps in (("default", default_block_m, 1), ("m128", lambda pairs, experts: 128, 4)):
        for gemm, kernel in (("w13", triton_moe._w13_swiglu_kernel), ("w2", triton_moe._w2_kernel)):
            jobs.append((f"moe_{gemm}_{tag}", functools.partial(sweep, kernel, fused_at(pick), cands["moe"], bench,
                                                                limit, warps)))
    if tiny:  # plumbing check: one sweep of each kind of kernel, two configs each
        jobs = [job for job in jobs if job[0] in ("attention_csa", "moe_w13_m128")]
    pairs = tokens * args.num_experts_per_tok
    out["moe_block_m_default"] = default_block_m(pairs, args.n_routed_experts)
    for name, job in jobs:
        start = time.time()
        try:
            out["sweeps"][name] = job()
        except Exception as e:
            out["sweeps"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        out["sweeps"][name]["seconds"] = round(time.time() - start, 1)
        best = out["sweeps"][name].get("best")
        print(f"[sweep] {name}: autotuned {out['sweeps'][name].get('autotuned_ms')} best {best}",
              file=sys.stderr, flush=True)
        checkpoint(out)
    return out


def summary(result: dict[str, Any]) -> list[str]:
    lines = []
    for r in result.get("parts", []):
        top = ", ".join(f"{c} {us / 1000:.2f}" for c, us in list(r["classes"].items())[:5])
        lines.append(f"layer {r['layer']} {r['type']:<28} {r['part']:<9} {r['ms']:8.3f} ms  [{top}]")
    for name, s in result.get("sweeps", {}).items():
        if "error" in s:
            lines.append(f"{name}: ERROR {s['error'][:120]}")
        else:
            lines.append(f"{name}: autotuned {s['autotuned_ms']:.3f} ms, best {s['best']}")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--tokens", type=int, default=None, help="prompt tokens (default: the layers bench's)")
    parser.add_argument("--tiny", action="store_true", help="toy widths (CPU, under TRITON_INTERPRET=1)")
    parser.add_argument("--no-sweeps", action="store_true", help="the parts' profiles only")
    opts = parser.parse_args(argv)
    device, shape, dtype, config = device_and_widths(parser, opts.tiny)
    tokens = opts.tokens or shape.prefill
    result: dict[str, Any] = {"env": environment(), "config": {"layers": LAYERS, "tokens": tokens,
                                                               "experts": "mxfp4", **config}}
    model = build_model(config, device, dtype)
    result["kernels"] = list(model.ops.table)
    # fast paths with a switch, named so an A/B run says which side it measured
    result["opt_in_paths"] = {"hc_mix_bf16x3": hc_kernels.SPLIT_BF16}

    def checkpoint(partial: dict[str, Any]) -> None:  # what a killed run leaves is still a result
        if opts.out:
            write_result(opts.out, {**result, **partial, "complete": False})

    result.update(run(model, tokens, shape.block_size, device, opts.tiny, checkpoint, not opts.no_sweeps))
    result["complete"] = True
    print("\n".join(summary(result)))
    if opts.out:
        write_result(opts.out, result)
    return result


if __name__ == "__main__":
    main()
