"""DeepSeek-V4's DSpark drafter on a GPU: what block drafting costs and gives the machine, at V4-Flash
width, against decoding without speculation and against MTP-1, and what its hand-over costs.

Model: bench/deepseek_v4_layers.py's four layers (sliding, CSA, HCA, CSA) at V4-Flash width, MXFP4
routed experts, random weights (``load_format=dummy``); the DSpark rows add the released 0731
drafter's shape (3 stages of V4 blocks with 256 MXFP4 experts each, features of the last three
layers, blocks of 5, Markov rank 256), the MTP rows one MTP layer. Random weights accept no draft,
so the acceptance is set by the benchmark (bench/v4_mtp_gpu.py's SetAcceptance: each draft taken
with probability ``a`` while those before it were, seeded), and the engine does all it does for
that many accepted tokens. For each batch (1, 8, 32): that many 512-token prompts, 48 new tokens,
the median interval between ``step()`` returns while every request decodes.
Rows:
  none-bB              no speculation: decode graphs, pipelined (the anchor, same run)
  verify-k5-bB         every request verifies 5 drafts (the last token repeated; no draft model)
  mtp-k1-aA-bB         MTP-1 (DeepSeek's comparison point), acceptance a
  dspark-k5-aA-bB      a DSpark block of 5 per step, acceptance a in (0, 0.5, 0.8, 0.9, 1); speedup
                       over none and over mtp-k1 at the same a; draft_ms = its a = 0 step less verify
  handover             per request of a 512-token prompt: the drafter's share of the KV blocks a
                       decode replica receives (its entries for the last window + 1 positions), the
                       hand-over's own bytes (layout and checksum), and the time to make it on the
                       prefill side and check it on the decode side (medians)
The anchors: DeepSeek reports DSpark 60-85% faster per user than MTP-1 at matched throughput; users
report about 4.4 accepted tokens per block with the released drafter (a ~ 0.9 per draft).
DSpark verify steps run synchronously (not pipelined); its blocks replay CUDA graphs where captured:
fast_paths says which (draft_graphs) and how many blocks replayed a graph or ran eagerly.

    python bench/v4_dspark_gpu.py --out bench/results/v4-dspark-h200-<date>.json
    python bench/v4_dspark_gpu.py --tiny --device cpu --out /tmp/v4-dspark.json   # plumbing check
"""
from __future__ import annotations

import argparse
import gc
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, write_result  # noqa: E402
from bench.deepseek_v4_layers import model_config  # noqa: E402
from bench.serve_gpu import WIDTH, write_model_dir  # noqa: E402
from bench.v4_mtp_gpu import run_method  # noqa: E402
from cluster import SamplingParams  # noqa: E402
from cluster.engine.engine import LLMEngine  # noqa: E402

BATCHES, ACCEPTANCE, PROMPT, NEW = (1, 8, 32), (0.0, 0.5, 0.8, 0.9, 1.0), 512, 48
TINY_RUN = ((1, 2), (0.0, 1.0), 24, 8)
BLOCK = 5
ANCHORS = {"dspark_over_mtp1_per_user": [1.60, 1.85], "dspark_accepted_tokens_per_block": 4.4}


def dspark_keys(config: dict[str, Any], tiny: bool) -> dict[str, Any]:
    n = int(config["num_hidden_layers"])
    return {"dspark_block_size": BLOCK, "dspark_target_layer_ids": list(range(max(0, n - 3), n)),
            "dspark_markov_rank": 8 if tiny else 256, "dspark_noise_token_id": 7 if tiny else 128799,
            "n_mtp_layers": 3, "num_nextn_predict_layers": 1}


def handover_costs(engine: LLMEngine, prompt: int, repeats: int) -> dict[str, Any]:
    """A prompt prefilled, then its hand-over made (prefill side) and checked (decode side)."""
    runner = engine.runner.drafter
    ids = [(13 * i + 5) % 1000 + 10 for i in range(prompt)]
    engine.add_request("handover", ids, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
    while engine.scheduler.requests["handover"].num_output_tokens == 0:
        engine.step()
    tables = engine.kv.block_tables("handover")
    position = engine.scheduler.requests["handover"].num_computed_tokens
    make, check, blob, ok = [], [], b"", True
    for _ in range(repeats):
        start = time.perf_counter()
        blob = runner.handover("handover", tables, position) or b""
        make.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        ok = ok and runner.receive("handover", tables, position, blob)
        check.append((time.perf_counter() - start) * 1e3)
    spec = engine.kv_specs[0]
    blocks = spec.blocks_needed(position) - spec.first_needed_block(position)
    stages = runner.drafter.spec.num_stages
    while engine.has_work():
        engine.step()
    return {"prompt_tokens": position, "swa_blocks_sent": blocks,
            "drafter_kv_bytes": blocks * spec.bytes_per_block * stages // spec.num_layers,
            "handover_bytes": len(blob), "make_ms": statistics.median(make), "check_ms": statistics.median(check),
            "checked_ok": ok}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"bench/results/v4-dspark-h200-{datetime.date.today()}.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy widths (plumbing check)")
    parser.add_argument("--batches", help="comma-separated batch sizes (default 1,8,32)")
    parser.add_argument("--acceptance", help="comma-separated set acceptances (default 0,0.5,0.8,0.9,1)")
    parser.add_argument("--block-graphs", choices=("on", "off"), default="on",
                        help="dspark_cuda_graphs for the dspark rows (default on)")
    args = parser.parse_args(argv)
    batches, acceptance, prompt, new = TINY_RUN if args.tiny else (BATCHES, ACCEPTANCE, PROMPT, NEW)
    if args.batches:  # a shorter run (what a few minutes of device time hold)
        batches = tuple(int(b) for b in args.batches.split(","))
    if args.acceptance:
        acceptance = tuple(float(a) for a in args.acceptance.split(","))
    on_gpu = args.device.startswith("cuda")
    base = dict(model_config(args.tiny), vocab_size=WIDTH["vocab_size"], torch_dtype="bfloat16")
    configs = {"none": base, "verify": base, "mtp": dict(base, num_nextn_predict_layers=1),
               "dspark": dict(base, **dspark_keys(base, args.tiny))}
    result: dict[str, Any] = {
        "benchmark": "v4-dspark", "config": configs["dspark"], "environment": environment(), "anchors": ANCHORS,
        "model": f"DeepSeek-V4-Flash width, {base['num_hidden_layers']} layers, MXFP4 experts, random weights; "
                 "dspark rows: + 3 DSpark stages (blocks of 5); mtp rows: + 1 MTP layer",
        "method": f"{prompt}-token prompts, {new} new tokens, median step; acceptance set by the benchmark "
                  "(see the script); none is the anchor", "rows": {}, "errors": {}, "fast_paths": {}}
    rows = result["rows"]
    for method, k in [("none", 0), ("verify", BLOCK), ("mtp", 1), ("dspark", BLOCK)]:
        with tempfile.TemporaryDirectory() as path:
            write_model_dir(path, configs[method])
            settings = {"dspark_cuda_graphs": args.block_graphs == "on"} if method == "dspark" else {}
            engine = run_method(result, path, args.device, method, k, acceptance, batches, prompt, new, **settings)
            if method == "dspark" and engine is not None:
                drafter = engine.runner.drafter
                result["fast_paths"][f"dspark-k{BLOCK}"].update(
                    graph_blocks=drafter.num_graph_blocks, eager_blocks=drafter.num_eager_blocks)
                try:
                    rows["handover"] = handover_costs(engine, prompt, 3 if args.tiny else 10)
                    print("handover", json.dumps(rows["handover"]), flush=True)
                except Exception as exc:  # noqa: BLE001
                    result["errors"]["handover"] = repr(exc)
            del engine
            gc.collect()  # an engine's cycles would keep its KV cache: the next engine's budget
            if on_gpu:
                torch.cuda.empty_cache()
    for batch in batches:
        none, verify = rows.get(f"none-b{batch}"), rows.get(f"verify-k{BLOCK}-b{batch}")
        if none and verify:
            verify["step_over_decode"] = verify["step_ms"] / none["step_ms"]
        idle = rows.get(f"dspark-k{BLOCK}-a0.0-b{batch}")
        if none and verify and idle:
            idle["draft_ms"] = idle["step_ms"] - verify["step_ms"]
            idle["draft_over_decode"] = idle["draft_ms"] / none["step_ms"]
        for a in acceptance:
            row, mtp = rows.get(f"dspark-k{BLOCK}-a{a}-b{batch}"), rows.get(f"mtp-k1-a{a}-b{batch}")
            if none and row:
                row["speedup_over_none"] = row["output_tok_s"] / none["output_tok_s"]
            if none and mtp:
                mtp["speedup_over_none"] = mtp["output_tok_s"] / none["output_tok_s"]
            if row and mtp:
                row["speedup_over_mtp1"] = row["output_tok_s"] / mtp["output_tok_s"]
    write_result(args.out, result)
    if result["errors"]:
        print("errors:", json.dumps(result["errors"], indent=1))
    return result


if __name__ == "__main__":
    main()
