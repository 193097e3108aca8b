"""Speculative decoding on a GPU: the Qwen3-8B-shaped bench model (random bf16 weights, as
bench/engine_gpu.py) with the n-gram proposer, against decode without speculation (pipelined
CUDA graphs, the anchor) measured in the same run, at batch 1 and 8.

Rows per batch:
  none     no speculation: pipelined graph decode (its % of the weight-read roofline too)
  ngram    prompt lookup, k drafts per step; verify steps replay the decode graphs (one row per
           verified position), pipelining off
  verify   every decoding request carries k drafts every step (its last token repeated, almost
           never right): the step time of a verify batch of 1 + k rows per request against a
           decode step (none), i.e. what verification costs; ``upper_bound_speedup`` = (1 + k) /
           that ratio is the most any proposer whose drafts are all accepted could give. (Drafts
           taken from the none row's tokens are no oracle here: a random model's logits are so
           flat that the verify rows' different kernel shapes flip its greedy tokens early, after
           which such drafts are all wrong.)
Prompts repeat a random 12-token phrase, so the contexts have n-grams to find; a random model's
greedy continuation decides how often the drafts are right, so the ngram row's acceptance says
nothing about real text (bench/spec_decode.py measures that on SmolLM2). Every row's tokens are
compared with the none row's.

    python bench/spec_decode_gpu.py --out bench/results/spec-decode-h200-<date>.json [--tiny]
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

from bench.common import environment, median, write_result  # noqa: E402
from bench.engine_gpu import QWEN3_8B, TINY, copy_bandwidth, random_model, weight_bytes  # noqa: E402
from cluster.common.sampling_params import SamplingParams  # noqa: E402
from cluster.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from cluster.engine.engine import LLMEngine  # noqa: E402


class RepeatLast:
    """k drafts every step: the last token repeated (a verify batch of 1 + k rows per request)."""

    name = "repeat_last"

    def propose(self, request: Any, k: int) -> list[int]:
        return [request.all_token_ids[-1]] * k

    def forget(self, request_id: str) -> None:
        pass


def prompts(batch: int, vocab: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        phrase = torch.randint(100, vocab - 100, (12,), generator=gen).tolist()
        head = torch.randint(100, vocab - 100, (length % 12,), generator=gen).tolist()
        out.append(head + phrase * (length // 12))
    return out


def engine_for(loaded: Any, device: str, method: str, k: int, max_num_seqs: int) -> LLMEngine:
    return LLMEngine(ModelConfig(model="random", device=device, dtype="bfloat16", max_model_len=4096,
                                 speculative_method="ngram" if method != "none" else "none",
                                 num_speculative_tokens=k),
                     CacheConfig(block_size=16, kv_cache_memory_bytes=4 << 30, enable_prefix_caching=False),
                     SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=16384), loaded=loaded)


def run(engine: LLMEngine, batch_prompts: list[list[int]], new_tokens: int, tag: str) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    groups = [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(batch_prompts)]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    times, outputs_seen = [], []
    start = time.perf_counter()
    graph0, eager0, piped0 = engine.runner.num_graph_steps, engine.runner.num_eager_steps, engine.num_pipelined_steps
    while engine.has_work():
        engine.step()
        times.append(time.perf_counter())
        outputs_seen.append(sum(g.samples[0].num_output_tokens for g in groups))
    sync()
    # decode phase: from the step that returned every first token to the end
    first = next(i for i, n in enumerate(outputs_seen) if n >= len(groups))
    decode_s = times[-1] - times[first]
    decode_tokens = outputs_seen[-1] - outputs_seen[first]
    steps = len(times) - 1 - first
    intervals = [b - a for a, b in zip(times[first:], times[first + 1:])]
    return {"tokens": [list(g.samples[0].output_token_ids) for g in groups],
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
            "decode_s": decode_s, "decode_steps": steps,
            "step_ms": 1000 * median(intervals[2:-2] or intervals) if intervals else 0.0, "tokens_per_step": decode_tokens / max(1, steps) / len(groups),
            "wall_s": times[-1] - start, "graph_steps": engine.runner.num_graph_steps - graph0,
            "eager_steps": engine.runner.num_eager_steps - eager0, "pipelined_steps": engine.num_pipelined_steps - piped0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"bench/results/spec-decode-h200-{datetime.date.today()}.json")
    parser.add_argument("--tiny", action="store_true", help="toy width (checks the script, measures nothing)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config = TINY if args.tiny or not cuda else QWEN3_8B
    loaded = random_model(config, torch.device(device), "auto")
    batches = [int(b) for b in args.batches.split(",")]
    max_seqs = max(batches)
    engines = {"none": engine_for(loaded, device, "none", args.k, max_seqs),
               "ngram": engine_for(loaded, device, "ngram", args.k, max_seqs)}
    verify_engine = engine_for(loaded, device, "verify", args.k, max_seqs)
    verify_engine.proposer = RepeatLast()
    bandwidth = copy_bandwidth(torch.device(device)) if cuda else None
    weights = weight_bytes(loaded.model)
    rows: dict[str, Any] = {}
    for batch in batches:
        batch_prompts = prompts(batch, config["vocab_size"], args.prompt_len, seed=batch)
        for engine in (*engines.values(), verify_engine):  # warm up (compiles, autotunes)
            run(engine, batch_prompts[:1], 8, f"warm{batch}")
        per: dict[str, list[dict[str, Any]]] = {"none": [], "ngram": [], "verify": []}
        for r in range(args.repeats):
            per["none"].append(run(engines["none"], batch_prompts, args.new_tokens, f"none-{batch}-{r}"))
            per["ngram"].append(run(engines["ngram"], batch_prompts, args.new_tokens, f"ngram-{batch}-{r}"))
            per["verify"].append(run(verify_engine, batch_prompts, args.new_tokens, f"verify-{batch}-{r}"))
        reference = per["none"][0]["tokens"]
        row: dict[str, Any] = {}
        for name, runs in per.items():
            tok_s = median([x["decode_tok_s"] for x in runs])
            row[name] = {"decode_tok_s_median": round(tok_s, 1),
                         "decode_tok_s_runs": [round(x["decode_tok_s"], 1) for x in runs],
                         "tokens_per_step": round(median([x["tokens_per_step"] for x in runs]), 3),
                         "step_ms_median": round(median([x["step_ms"] for x in runs]), 3),
                         "identical_to_none": all(x["tokens"] == reference for x in runs),
                         "graph_steps": runs[-1]["graph_steps"], "eager_steps": runs[-1]["eager_steps"],
                         "pipelined_steps": runs[-1]["pipelined_steps"]}
        for name in ("ngram", "verify"):
            row[name]["speedup_vs_none"] = round(row[name]["decode_tok_s_median"] / row["none"]["decode_tok_s_median"], 3)
        cost = row["verify"]["step_ms_median"] / row["none"]["step_ms_median"] if row["none"]["step_ms_median"] else 0.0
        row["verify"]["step_cost_vs_decode_step"] = round(cost, 3)
        row["verify"]["upper_bound_speedup"] = round((1 + args.k) / cost, 3) if cost else None
        if bandwidth:
            ctx = args.prompt_len + args.new_tokens // 2
            kv = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
            roof_s = (weights + batch * ctx * kv) / bandwidth
            row["none"]["pct_of_roofline"] = round(100 * row["none"]["decode_tok_s_median"] * roof_s / batch, 1)
        rows[f"b{batch}"] = row
        print(f"b{batch}", row, flush=True)
    result = {"bench": "spec_decode_gpu", "environment": environment(),
              "model": "qwen3-8b-shape random bf16" if config is QWEN3_8B else "tiny random",
              "k": args.k, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "copy_bandwidth_gbs": round(bandwidth / 1e9, 1) if bandwidth else None,
              "fast_paths": {name: {"cuda_graphs": e.runner.graph_status.describe(), "pipelined": e._pipelined,
                                    "graph_max_rows": e.runner.graphs.max_batch if e.runner.graphs else 0}
                             for name, e in {**engines, "verify": verify_engine}.items()},
              "prefix_caching": False,
              "anchor": "none: the same engine without speculation (pipelined CUDA graphs), same prompts, same run",
              "rows": rows}
    if config is not QWEN3_8B:
        result["note"] = "tiny model: checks the script, measures nothing"
    write_result(args.out, result)


if __name__ == "__main__":
    main()
