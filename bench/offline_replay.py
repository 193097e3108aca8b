"""A served run's closed-loop load replayed through the offline engine, with the served colocated
replica's prompt-chunk step target: what the engine alone does with the same requests.

The served colocated replica is a decode replica prefilling locally: its chunk sizer aims at
``local_prefill_itl_share * target_itl_s`` a step (``sized_chunks_per_step`` as configured). Here
the same engine settings, the same seeded prompts and output lengths (``bench/serve.py``'s
draws, from the row's recorded client config) and the same number of clients in flight (a
finished request's client sends the next at once), without Ray, HTTP or a load generator, and
without prefix caching (each repeat sends the same prompts again). Set
beside the served row and the simulator's prediction of it, it says how much of the served
TTFT is the engine's and how much the serving stack's, on the same machine.

    python bench/offline_replay.py --serve-file serve-cpu-2026-12-06-mixed.json --out bench/results/offline-replay-cpu-<date>.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, write_result  # noqa: E402
from bench.serve import BenchConfig, build_prompts, latency_stats  # noqa: E402
from cluster.config import ClusterConfig, TransferConfig  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def replay(llm: Any, config: BenchConfig) -> dict[str, Any]:
    """One closed-loop pass of the row's timed requests (after its warm-up ones)."""
    from cluster import SamplingParams
    prompts = build_prompts(config)
    warmup, timed = prompts[:config.warmup], prompts[config.warmup:]

    def params(out_len: int) -> Any:
        return SamplingParams(max_tokens=out_len, temperature=config.temperature, ignore_eos=True)
    llm.generate([p for p, _, _ in warmup], [params(n) for _, _, n in warmup])
    engine = llm.engine
    queue = list(range(len(timed)))
    sent: dict[int, float] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    gaps: list[float] = []
    tokens = 0

    def send() -> None:
        i = queue.pop(0)
        prompt, _, out_len = timed[i]
        engine.add_request(f"replay-{i}", prompt, params(out_len))
        sent[i] = time.perf_counter()
    start = time.perf_counter()
    for _ in range(min(int(config.concurrency or 1), len(queue))):
        send()
    live = len(sent)
    while live:
        for out in engine.step():
            i = int(out.request_id.rsplit("-", 1)[1])
            now = time.perf_counter()
            n = sum(len(s.token_ids) for s in out.outputs)
            tokens += n
            if n:
                if i in first:
                    gaps.append(now - last[i])
                else:
                    first[i] = now
                last[i] = now
            if out.finished:
                live -= 1
                if queue:
                    send()
                    live += 1
    wall = time.perf_counter() - start
    # percentiles as the served run's client computes them, so the two compare
    ttft = latency_stats([first[i] - sent[i] for i in first])
    itl = latency_stats(gaps)
    return {"ttft_p50_s": ttft["p50"], "ttft_p90_s": ttft["p90"], "itl_p50_s": itl["p50"], "itl_p90_s": itl["p90"],
            "output_tokens": tokens, "wall_s": wall, "output_token_throughput_tps": tokens / wall,
            "completed": len(first)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-file", required=True, help="a serve-cpu-*.json (bench/serve_compare.py)")
    parser.add_argument("--mode", default="colocated", help="whose load row to replay")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from cluster import LLM
    path = args.serve_file if os.path.exists(args.serve_file) else os.path.join(RESULTS, args.serve_file)
    with open(path) as f:
        serve = json.load(f)
    row = serve["runs"][args.mode]["load"]
    cfg = dict(row["config"], token_id_range=tuple(row["config"]["token_id_range"]))
    config = BenchConfig(**cfg)
    step_target = TransferConfig().local_prefill_itl_share * ClusterConfig().target_itl_s
    # prefix caching off: the repeats send the same prompts, which would otherwise hit the cache
    # (the served run's prompts are distinct random ids: it had no hits to give)
    llm = LLM(args.model, max_num_seqs=int(config.concurrency or 1), prefill_step_target_s=step_target,
              enable_prefix_caching=False)
    per_step = llm.engine.scheduler.config.sized_chunks_per_step
    runs = [replay(llm, config) for _ in range(args.repeats)]
    for r in runs:
        print({k: round(v, 3) for k, v in r.items()})
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    served = {"ttft_p50_s": row["ttft_s"]["p50"], "ttft_p90_s": row["ttft_s"]["p90"], "itl_p50_s": row["itl_s"]["p50"],
              "itl_p90_s": row["itl_s"]["p90"], "output_token_throughput_tps": row["output_token_throughput_tps"]}
    result = {"benchmark": "offline-replay", "environment": environment(), "serve_file": os.path.basename(path),
              "mode": args.mode, "client_config": row["config"], "prefill_step_target_s": step_target,
              "sized_chunks_per_step": per_step, "repeats": runs, "median": medians, "served": served,
              "served_over_offline": {k: served[k] / medians[k] for k in served if medians.get(k)},
              "note": "the served row's requests and clients in flight through the offline engine (no Ray, HTTP or "
                      "load generator), with the served colocated replica's chunk step target; medians of the repeats"}
    print("median", {k: round(v, 3) for k, v in medians.items()})
    print("served / offline", {k: round(v, 2) for k, v in result["served_over_offline"].items()})
    if args.out:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
