"""DeepSeek-V4-Flash-width decode through the engine: CUDA graphs against eager steps, on a GPU.

Model: bench/deepseek_v4_layers.py's four layers (sliding, CSA, HCA, CSA) at V4-Flash width, MXFP4
routed experts, random weights (``load_format=dummy``), the DeepSeek tokenizer's vocabulary. For
each batch (1, 8, 32): that many 512-token prompts, 64 new tokens each; the decode step time is
the median interval between ``step()`` returns while every request decodes
(``bench/engine_gpu.decode_steps``). Rows:
  eager-bN     ``enforce_eager``: every kernel launched from the host (the anchor, same run)
  graphs-bN    decode replayed from the captured graphs, pipelined (``async_scheduling``)
  speedup      eager step time / graph step time
  roofline     bytes a decode step must read / copy bandwidth measured here: every weight but the
               routed experts and the embedding (of which a row per sequence), the routed experts
               a batch touches (expected distinct experts of ``top_k`` uniform picks per token and
               layer: random routing), and the KV entries the step attends (window, compressed
               entries or the indexer's picks, indexer keys)

    python bench/v4_decode_gpu.py --out bench/results/v4-decode-h200-<date>.json
    python bench/v4_decode_gpu.py --tiny --device cpu --out /tmp/v4-decode.json   # plumbing check
(``--device cpu``: eager rows only, at toy sizes; a check of the script, not a measurement.)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, require_graphs  # noqa: E402
from bench.deepseek_v4_layers import expert_bytes, layer_cost, model_config  # noqa: E402
from bench.engine_gpu import copy_bandwidth, decode_steps  # noqa: E402
from bench.serve_gpu import WIDTH, write_model_dir  # noqa: E402
from cluster.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from cluster.engine.engine import LLMEngine  # noqa: E402

BATCHES, PROMPT, NEW = (1, 8, 32), 512, 64
TINY_RUN = ((1, 3), 24, 6)


def make_engine(path: str, device: str, eager: bool, max_num_seqs: int) -> LLMEngine:
    return LLMEngine(ModelConfig(model=path, load_format="dummy", device=device, dtype="bfloat16",
                                 enforce_eager=eager, max_model_len=2048),
                     CacheConfig(block_size=16, gpu_memory_utilization=0.85),
                     SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192))


def step_bytes(model: Any, batch: int, context: int) -> dict[str, float]:
    """Bytes one decode step of ``batch`` sequences at ``context`` tokens must read: per layer
    ``bench.deepseek_v4_layers.layer_cost`` (routed experts touched, KV attended) with its
    expected experts under uniform routing; outside the routed experts, every weight once but the
    embedding, of which a row per sequence (the logits head is read whole)."""
    args = model.args
    dense = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if ".experts." not in name and not name.startswith("embed."))
    dense += batch * model.embed.weight[0].numel() * model.embed.weight.element_size()
    experts = kv = 0.0
    e, k = args.n_routed_experts, args.num_experts_per_tok
    for kind, layer in zip(args.layer_types, model.layers):
        stack = layer.ffn.experts
        touched = e * (1 - (1 - k / e) ** batch)
        cost = layer_cost(args, kind, [context] * batch, [1] * batch, touched,
                          expert_bytes(stack.w13) + expert_bytes(stack.w2), (0, 0))
        experts += cost["weight_bytes"]
        kv += cost["kv_bytes"]
    return {"dense_bytes": dense, "routed_expert_bytes": experts, "kv_bytes": kv,
            "total_bytes": dense + experts + kv}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"bench/results/v4-decode-h200-{datetime.date.today()}.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy widths (plumbing check)")
    parser.add_argument("--modes", default="eager,graphs",
                        help="rows to run, of eager,graphs (a same-run baseline of an older tree: graphs)")
    args = parser.parse_args(argv)
    batches, prompt, new = TINY_RUN if args.tiny else (BATCHES, PROMPT, NEW)
    on_gpu = args.device.startswith("cuda")
    config = dict(model_config(args.tiny), vocab_size=WIDTH["vocab_size"], torch_dtype="bfloat16")
    result: dict[str, Any] = {
        "benchmark": "v4-engine-decode", "config": config, "environment": environment(),
        "model": f"DeepSeek-V4-Flash width, {config['num_hidden_layers']} layers, MXFP4 experts, random weights",
        "method": f"{prompt}-token prompts, {new} new tokens; median decode step; eager is the anchor",
        "rows": {}, "errors": {}}
    bandwidth = copy_bandwidth(torch.device(args.device), 0.25 if args.tiny else 2.0) if on_gpu else None
    result["copy_bandwidth_GBps"] = bandwidth / 1e9 if bandwidth else None
    rows = result["rows"]
    with tempfile.TemporaryDirectory() as path:
        write_model_dir(path, config)
        for mode in [m for m in args.modes.split(",") if on_gpu or m == "eager"]:
            try:
                engine = make_engine(path, args.device, mode == "eager", max(batches))
            except Exception as exc:  # noqa: BLE001 - record and go on
                result["errors"][mode] = repr(exc)
                continue
            result[f"{mode}_cuda_graphs"] = (require_graphs(engine, "V4 decode, graphs rows") if mode == "graphs"
                                             else engine.runner.graph_status.describe())
            result[f"{mode}_startup_s"] = engine.startup_timings
            result.setdefault("kernels", engine.backends())
            for batch in batches:
                name = f"{mode}-b{batch}"
                try:
                    row = decode_steps(engine, batch, prompt, new, name)
                    need = step_bytes(engine.model, batch, prompt + new // 2)
                    row.update(need)
                    if bandwidth:
                        roof_s = need["total_bytes"] / bandwidth
                        row.update(roofline_step_ms=1000 * roof_s, pct_of_roofline=100 * roof_s / (row["step_ms"] / 1000))
                    rows[name] = row
                    print(name, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
                except Exception as exc:  # noqa: BLE001
                    result["errors"][name] = repr(exc)
            del engine
            if on_gpu:
                torch.cuda.empty_cache()
    for batch in batches:
        eager, graphed = rows.get(f"eager-b{batch}"), rows.get(f"graphs-b{batch}")
        if eager and graphed:
            rows[f"speedup-b{batch}"] = {"eager_over_graphs": eager["step_ms"] / graphed["step_ms"]}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    if result["errors"]:
        print("errors:", json.dumps(result["errors"], indent=1))
    return result


if __name__ == "__main__":
    main()
