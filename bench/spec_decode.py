"""Speculative decoding against no speculation, batch 1, greedy, on the embedded default model
(SmolLM2 on the CPU by default): per prompt class, decode tokens per second with and without
speculation (the anchor, measured in the same run, alternating with it prompt by prompt), tokens
per engine step, drafts accepted, and whether the tokens are identical (they must be).

Prompt classes (two prompts each, through the chat template): a table to convert to JSON
(repetitive structure), a passage to summarise, code to edit (the answer repeats the code), open
chat (little to look up).

    python bench/spec_decode.py --out bench/results/spec-decode-cpu-<date>.json
    python bench/spec_decode.py --tiny        # a small random model: checks the script only
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, write_result  # noqa: E402

TABLE = """| id | name | city | age |
|----|------|------|-----|
| 1 | Alice Martin | Lyon | 34 |
| 2 | Bruno Costa | Porto | 41 |
| 3 | Chen Wei | Suzhou | 29 |
| 4 | Dana Levi | Haifa | 52 |
| 5 | Emil Berg | Malmo | 38 |
| 6 | Farah Khan | Lahore | 27 |"""

CODE = '''def total_price(items, tax):
    total = 0
    for item in items:
        price = item["price"]
        count = item["count"]
        total = total + price * count
    total = total + total * tax
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best'''

PASSAGE = ("A prefill worker computes the KV cache of a prompt and its first token; a decode worker "
           "generates the rest of the answer. Splitting the two lets each run at the batch size it "
           "likes best: prefill is bound by compute and wants long chunks, decode is bound by memory "
           "bandwidth and wants many sequences at once. The cost is the transfer of the KV blocks "
           "between them, which on one node is a copy at memory speed and across nodes goes over "
           "the network. A planner sizes the ratio of prefill to decode workers from the measured "
           "time to first token and time per output token.")

PROMPTS: dict[str, list[str]] = {
    "table_to_json": [f"Convert this table to a JSON list of objects, one per row:\n\n{TABLE}",
                      f"Write each row of this table as a JSON object with the same keys:\n\n{TABLE}"],
    "summarise": [f"Summarise this passage in three sentences:\n\n{PASSAGE}",
                  f"Rewrite this passage in simpler words:\n\n{PASSAGE}"],
    "code_edit": [f"Add type hints to these Python functions and return the full code:\n\n{CODE}",
                  f"Rename the variable total to amount in this code and return all of it:\n\n{CODE}"],
    "open_chat": ["What are some good habits for learning a new language?",
                  "Tell me about the history of tea in a few paragraphs."],
}


def tiny_model() -> str:
    from tests.factories import make_checkpoint
    path = tempfile.mkdtemp(prefix="spec-bench-")
    make_checkpoint(path, "llama", seed=11, max_position_embeddings=1024)
    return path


def run_one(llm: Any, prompt: str, params: Any) -> dict[str, Any]:
    engine = llm.engine
    steps0 = engine.num_sync_steps + engine.num_pipelined_steps
    stats = engine.spec_stats
    accepted0 = stats.num_accepted_tokens if stats else 0
    drafts0 = stats.num_draft_tokens if stats else 0
    start = time.perf_counter()
    out = llm.chat([{"role": "user", "content": prompt}], params)[0]
    elapsed = time.perf_counter() - start
    first = out.metrics.get("ttft_s")
    tokens = out.outputs[0].token_ids
    steps = engine.num_sync_steps + engine.num_pipelined_steps - steps0
    return {"tokens": tokens, "seconds": elapsed, "steps": steps, "first_token_s": first,
            "accepted": (stats.num_accepted_tokens - accepted0) if stats else 0,
            "drafted": (stats.num_draft_tokens - drafts0) if stats else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tiny", action="store_true", help="a small random model (checks the script)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=f"bench/results/spec-decode-cpu-{datetime.date.today()}.json")
    args = parser.parse_args()

    from cluster import LLM, SamplingParams
    model = tiny_model() if args.tiny else args.model
    max_tokens = 24 if args.tiny else args.max_tokens
    base = LLM(model)
    spec = LLM(model, speculative_method="ngram", num_speculative_tokens=args.k)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for llm in (base, spec):
        llm.chat([{"role": "user", "content": "hello"}], warm)

    rows: dict[str, Any] = {}
    pooled = {"none": [0, 0.0, 0], "ngram": [0, 0.0, 0]}  # tokens, decode seconds, steps
    for cls, prompts in PROMPTS.items():
        per_method: dict[str, list[dict[str, Any]]] = {"none": [], "ngram": []}
        identical = True
        for prompt in prompts:
            for r in range(args.rounds):
                order = (("none", base), ("ngram", spec)) if r % 2 == 0 else (("ngram", spec), ("none", base))
                got = {name: run_one(llm, prompt, params) for name, llm in order}
                identical &= got["none"]["tokens"] == got["ngram"]["tokens"]
                for name in ("none", "ngram"):
                    per_method[name].append(got[name])
        row: dict[str, Any] = {"identical_tokens": identical}
        for name, runs in per_method.items():
            # decode rate: tokens after the first over the time after the first token
            rates, steps_per = [], []
            for run in runs:
                n = len(run["tokens"])
                decode_s = run["seconds"] - (run["first_token_s"] or 0.0)
                rates.append((n - 1) / decode_s if decode_s > 0 else 0.0)
                steps_per.append((n - 1) / max(1, run["steps"] - 1))
                pooled[name][0] += n - 1
                pooled[name][1] += decode_s
                pooled[name][2] += max(1, run["steps"] - 1)
            row[name] = {"decode_tok_s_median": round(statistics.median(rates), 2),
                         "tokens_per_step_median": round(statistics.median(steps_per), 3),
                         "output_tokens": [len(r["tokens"]) for r in runs]}
            if name == "ngram":
                drafted = sum(r["drafted"] for r in runs)
                row[name]["draft_acceptance"] = round(sum(r["accepted"] for r in runs) / drafted, 3) if drafted else 0.0
        row["speedup"] = round(row["ngram"]["decode_tok_s_median"] / row["none"]["decode_tok_s_median"], 3)
        rows[cls] = row
        print(cls, row, flush=True)
    pooled_rate = {name: v[0] / v[1] for name, v in pooled.items()}
    result = {
        "bench": "spec_decode", "environment": environment(), "model": "tiny-random" if args.tiny else args.model,
        "batch": 1, "sampling": "greedy", "max_tokens": max_tokens, "rounds": args.rounds,
        "speculative_method": "ngram", "num_speculative_tokens": args.k,
        "prompt_lookup": [spec.engine.model_config.prompt_lookup_min, spec.engine.model_config.prompt_lookup_max],
        "fast_paths": {"device": str(spec.engine.device), "cuda_graphs_captured": spec.engine.runner.graph_status.captured,
                       "pipelined_decode": {"none": base.engine._pipelined, "ngram": spec.engine._pipelined},
                       "linear_kernels": sorted({r["impl"] for r in spec.engine.backends() if r["component"] != "cuda_graphs"})},
        "anchor": "no speculation, the same engine settings, alternating with speculation prompt by prompt",
        "classes": rows,
        "pooled": {"none_decode_tok_s": round(pooled_rate["none"], 2), "ngram_decode_tok_s": round(pooled_rate["ngram"], 2),
                   "speedup": round(pooled_rate["ngram"] / pooled_rate["none"], 3),
                   "ngram_tokens_per_step": round(pooled["ngram"][0] / pooled["ngram"][2], 3)},
        "all_identical": all(r["identical_tokens"] for r in rows.values()),
    }
    if args.tiny:
        result["note"] = "tiny random model: checks the script, measures nothing"
    print(result["pooled"], "identical:", result["all_identical"])
    write_result(args.out, result)


if __name__ == "__main__":
    main()
