"""DeepSeek-V4-Flash-shaped layers on one GPU: time per layer and % of its roofline.

A V4 model at the released V4-Flash widths (``tests.deepseek_factories.V4_FLASH_CONFIG``: hidden
4096, 64 heads x 512, 256 experts top-6, MoE intermediate 2048, indexer 64 x 128, window 128, ...)
but four layers (sliding, CSA, HCA, CSA; the first hash-routed), random bf16 weights at a sane
scale (``1 / sqrt(fan_in)``) and MXFP4 routed experts (``kernels.quant``), run directly through the
model with a ``ForwardContext`` built as the engine's model runner builds one, the kernels chosen
by ``kernels.dispatch`` for the device (the table is in the JSON). Scenarios:

- prefill: one 8,192-token prompt;
- decode at batch 1, 32 and 128: one new token per request after 4,096 tokens of context, whose
  KV groups (window, compressed entries, indexer keys, compressor state) hold random entries.

Each layer (and its attention and MoE halves) is timed alone on the inputs a full forward gave it
(``triton.testing.do_bench`` medians, L2 flushed; a wall clock on CPU). Its roofline is the larger
of (bytes it must move) / (copy bandwidth) and (FLOPs) / (bf16 matmul rate), both anchors measured
in the same run. Bytes: the layer's dense weights, the routed experts the step actually routes to
(packed MXFP4 bytes + scales) and the KV entries its queries read (each once per sequence). FLOPs:
its matmuls (routed experts at top-k per token), attention over each query's window and compressed
entries, and the indexer's scores. Decode runs eagerly (no CUDA graphs): at batch 1 the host's
kernel launches are most of what is measured. Each section records its own error.

    python3 bench/deepseek_v4_layers.py --out bench/results/deepseek_v4_layers-h200-<date>.json
    python3 bench/deepseek_v4_layers.py --tiny   # toy widths on CPU (the test runs this)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment  # noqa: E402
from cluster.common.kv_spec import KVGroupSpec  # noqa: E402
from cluster.models.context import ForwardContext  # noqa: E402
from cluster.models.deepseek_v4 import DeepseekV4Block, DeepseekV4ForCausalLM, kernel_components  # noqa: E402
from cluster.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Args  # noqa: E402
from cluster.models.dummy import init_dummy_weights  # noqa: E402
from kernels import triton_deepseek_v4_hc as hc_kernels  # noqa: E402
from kernels.quant import QuantizedWeight  # noqa: E402
from cluster.models.ops import resolve_ops  # noqa: E402
from tests.deepseek_factories import V4_FLASH_CONFIG  # noqa: E402

LAYERS = [SLIDING, CSA, HCA, CSA]


@dataclass(frozen=True)
class Shape:
    prefill: int  # prompt tokens
    context: int  # decode: tokens of context before the new one
    batches: tuple[int, ...]  # decode batch sizes
    block_size: int


FULL = Shape(prefill=8192, context=4096, batches=(1, 32, 128), block_size=16)
TINY = Shape(prefill=40, context=36, batches=(1, 3), block_size=4)
TINY_WIDTHS = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
                   q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=64, index_n_heads=4, index_head_dim=32, index_topk=4, sliding_window=8,
                   compress_rates={CSA: 4, HCA: 16})


def model_config(tiny: bool) -> dict[str, Any]:
    config = {k: v for k, v in V4_FLASH_CONFIG.items() if k not in ("compress_ratios", "quantization_config")}
    # Declared MXFP4 experts, so that dispatch resolves the MoE kernel for the format it runs.
    config.update(num_hidden_layers=len(LAYERS), layer_types=LAYERS, num_hash_layers=1, num_nextn_predict_layers=0,
                  quantization_config={"quant_method": "mxfp4"}, **(TINY_WIDTHS if tiny else {}))
    return config


def blocks(model: DeepseekV4ForCausalLM) -> list[DeepseekV4Block]:
    return [cast(DeepseekV4Block, layer) for layer in model.layers]


@torch.no_grad()
def build_model(config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0
                ) -> DeepseekV4ForCausalLM:
    """The model with native MXFP4 experts and random weights (``cluster.models.dummy``: the
    weights a ``load_format="dummy"`` replica serves)."""
    ops = resolve_ops(kernel_components(config), device)
    with torch.device(device):
        model = DeepseekV4ForCausalLM(DeepseekV4Args.from_hf(config), dtype, ops, native_experts=True)
    init_dummy_weights(model, config, seed)
    return model.eval()


def make_context(specs: list[KVGroupSpec], seq_lens: list[int], q_lens: list[int], device: torch.device,
                 dtype: torch.dtype) -> ForwardContext:
    """Random KV storage per group, each request's blocks shuffled across it, tables and window
    slots for the step's tokens (as ``ModelRunner._prepare`` builds them)."""
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, q_lens)])
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(q_lens))
    caches, tables, slots = [], [], []
    for spec in specs:
        needed = [spec.blocks_needed(s) for s in seq_lens]
        order = torch.randperm(sum(needed))
        table = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
        used = 0
        for r, n in enumerate(needed):
            table[r, :n] = order[used:used + n].to(torch.int32)
            used += n
        store_dtype = torch.float32 if spec.kind == "state" else dtype
        storage = 0.5 * torch.randn(sum(needed), spec.num_layers, *spec.block_shape, device=device)
        caches.append(storage.to(store_dtype))
        tables.append(table.to(device))
        slot = None
        if spec.kind in ("full", "sliding_window"):
            blocks = table.long()[seq_of, positions // spec.block_size]
            slot = (blocks * spec.block_size + positions % spec.block_size).to(device)
        slots.append(slot)
    return ForwardContext(
        positions=positions.to(device), query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens), kv_caches=caches, block_tables=tables, slot_mappings=slots,
        block_sizes=[s.block_size for s in specs])


def timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of ``fn``: do_bench on CUDA, a wall clock on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench
        return lambda fn: float(do_bench(fn, warmup=10, rep=60, return_mode="median"))

    def wall(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    return wall


def anchors(device: torch.device, tiny: bool) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and the bf16 matmul rate, measured here."""
    bench = timer(device)
    n, mm = (1 << 20, 256) if tiny else (1 << 30, 8192)
    src = torch.randn(n, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = bench(functools.partial(dst.copy_, src))
    del src, dst
    a, b = (torch.randn(mm, mm, device=device).to(torch.bfloat16) for _ in range(2))
    mm_ms = bench(functools.partial(torch.matmul, a, b))
    return {"copy_tb_s": 4 * n / copy_ms / 1e9, "matmul_tflop_s": 2 * mm ** 3 / mm_ms / 1e9,
            "copy_ms": copy_ms, "matmul_ms": mm_ms}


def dense_bytes_and_params(layer: torch.nn.Module) -> tuple[int, int]:
    """(bytes of every non-expert parameter, elements of its matrices) of one layer."""
    nbytes = matrix = 0
    for name, p in layer.named_parameters():
        nbytes += p.numel() * p.element_size()
        if p.dim() == 2:
            matrix += p.numel()
    return nbytes, matrix


def expert_bytes(w: Any) -> int:
    """Bytes of one expert of a stacked weight (data + scales)."""
    parts = [w.data] + ([w.scale] if isinstance(w, QuantizedWeight) and w.scale is not None else [])
    return sum(t[0].numel() * t.element_size() for t in parts)


def layer_cost(args: DeepseekV4Args, kind: str, seq_lens: list[int], q_lens: list[int],
               experts_touched: float, per_expert: int, dense: tuple[int, int]) -> dict[str, float]:
    """Bytes and FLOPs one layer must move and compute for this step (module docstring)."""
    tokens = sum(q_lens)
    ratio = args.ratio(kind)
    d, di, w = args.head_dim, args.index_head_dim, args.sliding_window
    kv = flops = 0.0
    for seq_len, q_len in zip(seq_lens, q_lens):
        first = seq_len - q_len
        kv += min(seq_len, q_len + w - 1) * d * 2
        if kind != SLIDING:
            entries = seq_len // ratio
            kv += (min(entries, args.index_topk * q_len) if kind == CSA else entries) * d * 2
            kv += entries * di * 2 if kind == CSA else 0
        for p in range(first, seq_len):
            visible = (p + 1) // ratio if ratio else 0
            picked = min(visible, args.index_topk) if kind == CSA else visible
            flops += 4 * args.num_heads * d * (min(w, p + 1) + picked)
            flops += 2 * args.index_n_heads * di * visible if kind == CSA else 0
    inter, hidden = args.moe_intermediate_size, args.hidden_size
    flops += 2 * tokens * dense[1] + 2 * tokens * args.num_experts_per_tok * 3 * hidden * inter
    weight_bytes = dense[0] + experts_touched * per_expert
    return {"weight_bytes": weight_bytes, "kv_bytes": kv, "bytes": weight_bytes + kv, "flops": flops}


class Capture:
    """Inputs of every layer, of its attention and of its MoE during one forward, and the routed
    experts each MoE touched."""

    def __init__(self, model: DeepseekV4ForCausalLM) -> None:
        self.inputs: dict[tuple[int, str], tuple[Any, ...]] = {}
        self.experts: dict[int, int] = {}
        self.handles = []
        for i, layer in enumerate(blocks(model)):
            for part, module in (("layer", layer), ("attn", layer.attn), ("ffn", layer.ffn)):
                self.handles.append(module.register_forward_pre_hook(self._keep(i, part)))
            self.handles.append(layer.ffn.gate.register_forward_hook(self._count(i)))

    def _keep(self, i: int, part: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
            self.inputs[(i, part)] = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
        return hook

    def _count(self, i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, inputs: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            self.experts[i] = int(output[1].unique().numel())
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def scenario(model: DeepseekV4ForCausalLM, seq_lens: list[int], q_lens: list[int], device: torch.device,
             rates: dict[str, float], block_size: int) -> dict[str, Any]:
    args = model.args
    ctx = make_context(model.kv_cache_specs(block_size, "bfloat16"), seq_lens, q_lens, device, model.dtype)
    input_ids = torch.randint(0, args.vocab_size, (sum(q_lens),), device=device)
    capture = Capture(model)
    model(input_ids, ctx)
    capture.remove()
    bench = timer(device)
    rows: list[dict[str, Any]] = []
    for i, layer in enumerate(blocks(model)):
        kind = args.layer_types[i]
        parts: tuple[tuple[str, torch.nn.Module], ...] = (("layer", layer), ("attn", layer.attn), ("ffn", layer.ffn))
        ms = {part: bench(functools.partial(module, *capture.inputs[(i, part)])) for part, module in parts}
        dense = dense_bytes_and_params(layer)
        cost = layer_cost(args, kind, seq_lens, q_lens, capture.experts[i],
                          expert_bytes(layer.ffn.experts.w13) + expert_bytes(layer.ffn.experts.w2), dense)
        memory_ms = cost["bytes"] / (rates["copy_tb_s"] * 1e9)
        compute_ms = cost["flops"] / (rates["matmul_tflop_s"] * 1e9)
        roofline = max(memory_ms, compute_ms)
        rows.append({"layer": i, "type": kind, "ms": ms["layer"], "attention_ms": ms["attn"], "moe_ms": ms["ffn"],
                     "experts_touched": capture.experts[i], **cost, "roofline_ms": roofline,
                     "bound": "memory" if memory_ms >= compute_ms else "compute",
                     "percent_of_roofline": 100 * roofline / ms["layer"]})
    return {"seq_lens": sorted(set(seq_lens)), "batch": len(seq_lens), "tokens": sum(q_lens), "layers": rows,
            "ms_per_layer": statistics.mean(r["ms"] for r in rows)}


def run_section(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    start = time.time()
    try:
        results[name] = fn()
    except Exception as e:  # record and keep going: one failure must not lose the other sections
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    if isinstance(results[name], dict):
        results[name]["seconds"] = round(time.time() - start, 1)
    print(f"[{name}] {results[name].get('error', 'ok') if isinstance(results[name], dict) else 'ok'}",
          file=sys.stderr, flush=True)


def summary(results: dict[str, Any]) -> list[str]:
    lines = [f"{'scenario':<16}{'layer':>6} {'type':<30}{'ms':>9}{'attn':>9}{'moe':>9}{'roof ms':>9}"
             f"{'%roof':>7}  bound"]
    for name, section in results.items():
        if not name.startswith(("prefill", "decode")):
            continue
        if "error" in section:
            lines.append(f"{name:<16} ERROR {section['error'][:100]}")
            continue
        for r in section["layers"]:
            lines.append(f"{name:<16}{r['layer']:>6} {r['type']:<30}{r['ms']:>9.3f}{r['attention_ms']:>9.3f}"
                         f"{r['moe_ms']:>9.3f}{r['roofline_ms']:>9.3f}{r['percent_of_roofline']:>6.1f}%  {r['bound']}")
    return lines


def device_and_widths(parser: argparse.ArgumentParser, tiny: bool
                      ) -> tuple[torch.device, Shape, torch.dtype, dict[str, Any]]:
    """The GPU (the CPU for ``--tiny``), the scenarios' shape, the model's dtype and config."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not tiny:
        parser.error("full V4-Flash widths need a CUDA GPU; use --tiny on CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, TINY if tiny else FULL, dtype, model_config(tiny)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="JSON file to write (e.g. bench/results/deepseek_v4_layers-h200.json)")
    parser.add_argument("--tiny", action="store_true", help="toy widths (runs on CPU)")
    opts = parser.parse_args(argv)
    device, shape, dtype, config = device_and_widths(parser, opts.tiny)
    results: dict[str, Any] = {"env": environment(), "config": {"layers": LAYERS, **asdict(shape),
                                                                "dtype": str(dtype), "experts": "mxfp4", **config}}
    # fast paths with a switch, named so an A/B run says which side it measured
    results["opt_in_paths"] = {"hc_mix_bf16x3": hc_kernels.SPLIT_BF16}
    run_section(results, "anchors", lambda: anchors(device, opts.tiny))
    holder: dict[str, DeepseekV4ForCausalLM] = {}
    run_section(results, "model", lambda: {"kernels": list((holder.setdefault(
        "m", build_model(config, device, dtype))).ops.table)})
    if "m" in holder and "error" not in results["anchors"]:
        model, rates = holder["m"], results["anchors"]
        run_section(results, "prefill", lambda: scenario(model, [shape.prefill], [shape.prefill], device, rates,
                                                         shape.block_size))
        for batch in shape.batches:
            lens = [shape.context + 1] * batch
            run_section(results, f"decode_b{batch}", lambda lens=lens: scenario(  # type: ignore[misc]
                model, lens, [1] * len(lens), device, rates, shape.block_size))
    print("\n".join(summary(results)))
    if opts.out:
        os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
        with open(opts.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()
