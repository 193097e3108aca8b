"""Where a DeepSeek-V4 decode step's GPU time goes (issue 17's profile), at V4-Flash width.

Model and workload as ``bench/v4_decode_gpu.py`` (its four layers, MXFP4 routed experts, random
weights; for each batch, 512-token prompts, then decode). Two passes per batch:

  scoped (eager)   every part of the model wrapped in a ``record_function`` scope (its class:
                   projections, hyper-connections, compressor, indexer, sparse attention, router,
                   MoE, norms and rotary, the attention's KV writes and glue, logits); each kernel's
                   GPU time goes to the innermost scope that launched it. This gives the class of
                   every kernel name.
  graphs           the same steps replayed from CUDA graphs (pipelined), under ``torch.profiler``:
                   kernel time per step by kernel name, then by class through the scoped pass's
                   name -> class map, or for our Triton kernels their name (``TRITON_KERNEL_CLASSES``:
                   the profiler does not tie a Triton launch, made through the driver API, to the
                   scope that made it, so the scoped pass never sees them; its rows leave them
                   out); a name neither knows is ``unmapped``; kernels
                   per step; the step's wall time. A generic kernel (an elementwise add, a
                   reduction) that several classes launch is split between them as its time was
                   in the scoped pass.

Per class, the bytes it must read (weights of its modules; for MoE the routed experts a batch
touches under uniform routing; for attention + indexer the KV entries attended, as
``bench.deepseek_v4_layers.layer_cost``) over the copy bandwidth measured in the same run give its
roofline time and the percent of it reached.

    python3 bench/v4_decode_profile.py --out bench/results/v4-decode-profile-h200-<date>.json
    python3 bench/v4_decode_profile.py --tiny --device cpu --out /tmp/p.json   # plumbing check: CPU self time
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, median, write_result  # noqa: E402
from bench.decode_profile import KERNEL_NAME_CHARS, kernel_times, profiled_steps  # noqa: E402
from bench.deepseek_v4_layers import model_config  # noqa: E402
from bench.engine_gpu import add_random_requests, copy_bandwidth  # noqa: E402
from bench.serve_gpu import WIDTH, write_model_dir  # noqa: E402
from bench.v4_decode_gpu import make_engine, step_bytes  # noqa: E402

PREFIX = "v4/"
CLASSES = ("projections", "hyper_connections", "compressor", "indexer", "sparse_attention", "router", "moe",
           "norms_rotary", "attention_glue", "logits", "outside_model")


#: Our Triton kernels by the class of the code that launches them (``kernels/triton_*.py``).
TRITON_KERNEL_CLASSES = {
    "_w13_swiglu_kernel": "moe", "_w2_kernel": "moe", "_sum_top_k_kernel": "moe", "_align_kernel": "moe",
    "_silu_and_mul_kernel": "moe",  # the shared expert's activation
    "_hc_mix_kernel": "hyper_connections", "_hc_pre_finish_kernel": "hyper_connections",
    "_hc_post_kernel": "hyper_connections",
    "_compress_decode_kernel": "compressor", "_compress_decode_paged_kernel": "compressor",
    "_compress_store_kernel": "compressor",
    "_indexer_scores_kernel": "indexer", "_topk_kernel": "indexer",
    "_sparse_attention_kernel": "sparse_attention", "_merge_kernel": "sparse_attention",
    "_norm_rope_kernel": "norms_rotary", "_rms_norm_kernel": "norms_rotary", "_rotary_kernel": "norms_rotary",
    "_route_kernel": "router", "_filter_kernel": "outside_model",
}


def kernel_class(name: str, name_class: dict[str, dict[str, float]]) -> dict[str, float]:
    """A kernel name's class shares: as the scoped pass saw it, else by our Triton kernel's name."""
    if name in name_class:
        return name_class[name]
    if name in TRITON_KERNEL_CLASSES:
        return {TRITON_KERNEL_CLASSES[name]: 1.0}
    return {"unmapped": 1.0}


def roofline_by_class(classes: dict[str, dict[str, float]], need: dict[str, float],
                      bandwidth: float) -> dict[str, dict[str, float | None]]:
    """Per class of bytes (``class_bytes``), its time at the copy bandwidth against the time spent."""
    out: dict[str, dict[str, float | None]] = {}
    for cls, nbytes in need.items():
        roof_us = 1e6 * nbytes / bandwidth
        spent = sum(classes.get(c, {}).get("us_per_step", 0.0)
                    for c in (("sparse_attention", "indexer") if cls == "attention_and_indexer_kv" else (cls,)))
        out[cls] = {"roofline_us": roof_us, "spent_us": spent, "pct_of_roofline": 100 * roof_us / spent if spent else None}
    return out


def classes_from_table(table: list[dict[str, Any]], name_class: dict[str, dict[str, float]]
                       ) -> dict[str, dict[str, float]]:
    """Per-class time and kernels a step from a row's kernel table (``us_per_step``, ``calls_per_step``)."""
    per_class: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for k in table:
        for cls, share in kernel_class(k["kernel"], name_class).items():  # a generic kernel: split as in eager
            per_class[cls][0] += k["us_per_step"] * share
            per_class[cls][1] += k["calls_per_step"] * share
    return {c: {"us_per_step": v[0], "kernels_per_step": v[1]}
            for c, v in sorted(per_class.items(), key=lambda kv: -kv[1][0])}


def _scoped(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(PREFIX + name):
            return fn(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def scopes(model: nn.Module) -> Iterator[None]:
    """Wrap the model's parts in their class's scope for the duration (eager steps only)."""
    from cluster.models import deepseek_v4
    from cluster.models.deepseek_v4_attention import DeepseekV4Attention, Indexer
    from cluster.models.deepseek_v4_layers import V4RMSNorm
    from cluster.models.deepseek_v4_moe import DeepseekV4MoE, Gate
    from cluster.models.layers import FusedRows, Linear
    undo: list[Callable[[], None]] = []

    def patch(obj: Any, attr: str, name: str) -> None:
        old = getattr(obj, attr)
        setattr(obj, attr, _scoped(name, old))
        undo.append(lambda: setattr(obj, attr, old))

    patch(deepseek_v4, "hc_head", "hyper_connections")
    for module in model.modules():
        if isinstance(module, Linear):
            patch(module, "forward", "projections")
        elif isinstance(module, V4RMSNorm):
            patch(module, "forward", "norms_rotary")
        elif isinstance(module, Gate):
            patch(module, "forward", "router")
        elif isinstance(module, Indexer):
            patch(module, "select", "indexer")
            patch(module, "norm_rope", "norms_rotary")
        elif isinstance(module, DeepseekV4Attention):
            patch(module, "norm_rope", "norms_rotary")
            patch(module, "forward", "attention_glue")
            patch(module, "_compress", "compressor")
            patch(module, "_grouped_wo_a", "projections")
            patch(module, "attention_kernel", "sparse_attention")
        elif isinstance(module, DeepseekV4MoE):
            patch(module, "moe_kernel", "moe")
        for fused in [v for v in vars(module).values() if isinstance(v, FusedRows)]:
            patch(fused, "forward", "projections")  # one GEMM for several Linears (and the gate's)
        if callable(getattr(module, "hc_pre", None)):  # a block or a DSpark stage
            patch(module, "hc_pre", "hyper_connections")
            patch(module, "hc_post", "hyper_connections")
    patch(model, "compute_logits", "logits")
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


def _class_of(event: Any) -> str:
    parent = event
    while parent is not None:
        if parent.name.startswith(PREFIX):
            return parent.name[len(PREFIX):]
        parent = parent.cpu_parent
    return "outside_model"


def _settle(engine: Any, batch: int, prompt: int, new: int, tag: str) -> None:
    """Requests in, past every prefill, a few decode steps to warm up."""
    add_random_requests(engine, batch, prompt, new, tag, seed=batch)
    while engine.scheduler.waiting or any(g.samples[0].num_output_tokens == 0 for g in engine.groups.values()):
        engine.step()
    for _ in range(4):
        engine.step()


def _profiled_steps(engine: Any, steps: int, on_gpu: bool, host_ops: bool = True) -> tuple[Any, list[float]]:
    """``host_ops``: record the host's ops too (the scopes, and which op launched each kernel)."""
    activities = [torch.profiler.ProfilerActivity.CUDA] if on_gpu else []
    if host_ops or not on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    return profiled_steps(engine, steps, activities)


def scoped_pass(engine: Any, batch: int, prompt: int, new: int, steps: int, on_gpu: bool
                ) -> tuple[dict[str, Any], dict[str, collections.Counter[str]]]:
    """Eager steps with scopes: (per-class time and kernels per step, kernel name -> class times)."""
    _settle(engine, batch, prompt, new, f"s{batch}")
    with scopes(engine.model):
        prof, walls = _profiled_steps(engine, steps, on_gpu)
    per_class: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    names: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for event in prof.events():
        if on_gpu:
            kernels = [(k.name, k.duration) for k in getattr(event, "kernels", [])]
        else:  # plumbing check: the op's own CPU time stands for its kernels
            kernels = [(event.name, event.self_cpu_time_total)] if not event.name.startswith(PREFIX) else []
        if not kernels:
            continue
        cls = _class_of(event)
        for name, us in kernels:
            per_class[cls][0] += us
            per_class[cls][1] += 1
            names[name[:KERNEL_NAME_CHARS]][cls] += us
    row = {"batch": batch, "steps": steps, "step_wall_ms": 1000 * median(walls[1:] or walls),
           "time_unit": "GPU kernel time" if on_gpu else "CPU self time (plumbing check)",
           "classes": {c: {"us_per_step": v[0] / steps, "kernels_per_step": v[1] / steps}
                       for c, v in sorted(per_class.items(), key=lambda kv: -kv[1][0])}}
    row["total_ms_per_step"] = sum(v[0] for v in per_class.values()) / steps / 1000
    row["kernels_per_step"] = sum(v[1] for v in per_class.values()) / steps
    return row, names


def graph_pass(engine: Any, batch: int, prompt: int, new: int, steps: int,
               name_class: dict[str, dict[str, float]]) -> dict[str, Any]:
    _settle(engine, batch, prompt, new, f"g{batch}")
    prof, walls = _profiled_steps(engine, steps, True, host_ops=False)
    kernels = kernel_times(prof)
    table = sorted(({"kernel": n, "classes": kernel_class(n, name_class), "us_per_step": v[0] / steps,
                     "calls_per_step": v[1] / steps} for n, v in kernels.items()), key=lambda r: -r["us_per_step"])
    return {"batch": batch, "steps": steps, "step_wall_ms": 1000 * median(walls[1:] or walls),
            "gpu_kernel_ms_per_step": sum(v[0] for v in kernels.values()) / steps / 1000,
            "kernels_per_step": sum(v[1] for v in kernels.values()) / steps,
            "classes": classes_from_table(table, name_class), "kernels": table[:50]}


def class_bytes(model: Any, batch: int, context: int) -> dict[str, float]:
    """Bytes each class must read in one decode step (see the module's docstring)."""
    from cluster.models.deepseek_v4_moe import Gate
    from cluster.models.layers import Linear
    out: dict[str, float] = collections.defaultdict(float)
    for name, module in model.named_modules():
        if module is model.head:  # the LM head is the logits class's
            continue
        if isinstance(module, Linear) and ".experts." not in name and not name.startswith("mtp"):
            out["projections"] += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        elif isinstance(module, Gate) and not name.startswith("mtp"):
            # the gate's GEMM runs with the shared expert's (``DeepseekV4MoE.x_proj``): a projection
            out["projections"] += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    weight = model.embed.weight if model.head is None else model.head.weight
    out["logits"] += weight.numel() * weight.element_size()
    routed = step_bytes(model, batch, context)  # the routed experts touched and the KV attended
    out["moe"] += routed["routed_expert_bytes"]
    out["attention_and_indexer_kv"] += routed["kv_bytes"]
    return dict(out)


def reclassify(path: str, out: str) -> dict[str, Any]:
    """An earlier result's graphs rows with their Triton kernels in their classes (``kernel_class``);
    the bytes per class from the scoped row of the same batch; nothing re-measured."""
    with open(path) as f:
        result = json.load(f)
    bandwidth = 1e9 * result["copy_bandwidth_GBps"]
    for key, row in result["rows"].items():
        if not key.startswith("graphs-"):
            continue
        row["classes"] = classes_from_table(row["kernels"], result.get("kernel_classes", {}))
        for k in row["kernels"]:
            k["classes"] = kernel_class(k["kernel"], result.get("kernel_classes", {}))
        need = result["rows"].get(key.replace("graphs-", "scoped-"), {}).get("bytes")
        if need:
            row["bytes"] = need
            row["roofline"] = roofline_by_class(row["classes"], need, bandwidth)
        row["classes_from"] = "the row's kernel table (its 50 largest kernels), reclassified by bench/v4_decode_profile.py --reclassify"
    result["reclassified_from"] = os.path.basename(path)
    result["reclassified_environment"] = environment()  # the run's own stays in "environment"
    write_result(out, result)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"bench/results/v4-decode-profile-h200-{datetime.date.today()}.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tiny", action="store_true", help="toy widths (plumbing check)")
    parser.add_argument("--reclassify", default=None,
                        help="a result file: recompute its graphs rows' classes and per-class rooflines from their "
                             "kernel tables (the 50 largest kernels) with the Triton names, and write it to --out")
    args = parser.parse_args(argv)
    if args.reclassify:
        return reclassify(args.reclassify, args.out)
    on_gpu = args.device.startswith("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    prompt, new = (24, args.steps + 12) if args.tiny else (512, args.steps + 24)
    config = dict(model_config(args.tiny), vocab_size=WIDTH["vocab_size"], torch_dtype="bfloat16")
    bandwidth = copy_bandwidth(torch.device(args.device), 0.25 if args.tiny else 2.0) if on_gpu else None
    result: dict[str, Any] = {
        "benchmark": "v4-decode-profile", "config": config, "environment": environment(),
        "model": f"DeepSeek-V4-Flash width, {config['num_hidden_layers']} layers, MXFP4 experts, random weights",
        "method": (f"{prompt}-token prompts; {args.steps} decode steps profiled per batch, eager with scopes "
                   "(class of each kernel) and replayed from CUDA graphs (pipelined)"),
        "copy_bandwidth_GBps": bandwidth / 1e9 if bandwidth else None, "rows": {}, "errors": {}}
    name_class: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as path:
        write_model_dir(path, config)
        engine = make_engine(path, args.device, True, max(batches))
        result["kernels_chosen"] = engine.backends()
        votes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for batch in batches:
            try:
                row, names = scoped_pass(engine, batch, prompt, new, args.steps, on_gpu)
            except Exception as exc:  # noqa: BLE001 - record and go on
                result["errors"][f"scoped-b{batch}"] = repr(exc)
                continue
            need = class_bytes(engine.model, batch, prompt + args.steps)
            row["bytes"] = need
            if bandwidth:  # Triton kernels are not in these rows (module docstring): see the graphs rows'
                row["roofline"] = roofline_by_class(row["classes"], need, bandwidth)
            result["rows"][f"scoped-b{batch}"] = row
            for name, counter in names.items():
                votes[name].update(counter)
            print(f"scoped-b{batch}", json.dumps({c: round(v["us_per_step"], 1) for c, v in row["classes"].items()}))
        name_class = {name: {c: round(t / sum(counter.values()), 4) for c, t in counter.items()}
                      for name, counter in votes.items() if sum(counter.values()) > 0}
        del engine
        if on_gpu:
            torch.cuda.empty_cache()
            engine = make_engine(path, args.device, False, max(batches))
            result["graphs_cuda_graphs"] = engine.runner.graph_status.describe()
            for batch in batches:
                try:
                    row = graph_pass(engine, batch, prompt, new, args.steps, name_class)
                except Exception as exc:  # noqa: BLE001
                    result["errors"][f"graphs-b{batch}"] = repr(exc)
                    continue
                need = class_bytes(engine.model, batch, prompt + args.steps)
                row["roofline_ms"] = 1000 * sum(need.values()) / bandwidth
                row["pct_of_roofline"] = 100 * row["roofline_ms"] / row["step_wall_ms"]
                row["bytes"] = need
                row["roofline"] = roofline_by_class(row["classes"], need, bandwidth)
                result["rows"][f"graphs-b{batch}"] = row
                print(f"graphs-b{batch}", json.dumps({k: v for k, v in row.items() if k not in ("kernels", "classes")}))
                for c, v in row["classes"].items():
                    print(f"  {v['us_per_step']:9.1f} us  x{v['kernels_per_step']:6.1f}  {c}")
            del engine
    result["kernel_classes"] = name_class
    write_result(args.out, result)
    if result["errors"]:
        print("errors:", json.dumps(result["errors"], indent=1))
    return result


if __name__ == "__main__":
    main()
