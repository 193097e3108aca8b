"""Speculative decoding against no speculation, greedy, on the embedded default model (SmolLM2,
on the CPU, or on the GPU where there is one): per prompt class at batch 1, decode tokens per
second of each method (``--methods``: ngram, draft_head (``--speculative-model``, default the
shipped head, with the draft vocabulary beside it), draft_head_shipped (the shipped head, beside a
new one), draft_head_full_vocab (the head drafting over the whole vocabulary), draft_head_greedy_drafts
(a sampled request's drafts the head's argmax: ``speculative_draft_sampling="greedy"``)) and without speculation (the anchor,
measured in the same run, the methods' order rotating prompt by prompt), tokens per engine step,
drafts accepted, and whether the tokens are identical (they must be); with ``--batch B`` also
all prompts at once in batches of B (output tokens per second of wall time, prefill included).
``--temperature T`` samples instead of greedy, seeded (``--seed``), so identity still holds
(``--seed -1``: unseeded; identity is then not expected). Both pipeline on a GPU.

Prompt classes (two prompts each, through the chat template): a table to convert to JSON
(repetitive structure), a passage to summarise, code to edit (the answer repeats the code), open
chat (little to look up).

    python bench/spec_decode.py --methods ngram,draft_head --out bench/results/spec-decode-cpu-<date>.json
    python bench/spec_decode.py --model <SmolLM2 .gguf> --batch 8 --out ...   # on the GPU machine
    python bench/spec_decode.py --tiny        # a small random model (and head): checks the script only
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


def _draft_vocab_size(engine: Any) -> int:
    """The tokens a draft head engine may draft (its draft vocabulary, else the whole one)."""
    head = engine.runner.drafter.head
    return int(head.vocab_ids.numel()) if head.vocab_ids is not None else int(head.vocab_size)


def tiny_model() -> tuple[str, str]:
    """A small random Llama checkpoint and a random draft head for it."""
    import torch
    from safetensors.torch import save_file

    from cluster.models.draft_head import LlamaDraftHead, head_metadata
    from cluster.models.llama import LlamaArgs
    from cluster.models.loader import read_config
    from tests.factories import make_checkpoint
    path = tempfile.mkdtemp(prefix="spec-bench-")
    make_checkpoint(path, "llama", seed=11, max_position_embeddings=1024)
    args = LlamaArgs.from_hf(read_config(path))
    head = LlamaDraftHead(args, args.num_layers, torch.float32)
    gen = torch.Generator().manual_seed(3)
    state = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in head.state_dict().items()}
    head_path = os.path.join(tempfile.mkdtemp(prefix="spec-bench-head-"), "head.safetensors")
    save_file(state, head_path, metadata=head_metadata(args, "tiny-random"))
    return path, head_path


def run_one(llm: Any, prompts: list[str], params: Any) -> dict[str, Any]:
    engine = llm.engine
    steps0 = engine.num_sync_steps + engine.num_pipelined_steps
    stats = engine.spec_stats
    accepted0 = stats.num_accepted_tokens if stats else 0
    drafts0 = stats.num_draft_tokens if stats else 0
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.perf_counter() - start
    steps = engine.num_sync_steps + engine.num_pipelined_steps - steps0
    return {"tokens": [o.outputs[0].token_ids for o in outs], "seconds": elapsed, "steps": steps,
            "first_token_s": max(o.metrics.get("ttft_s") or 0.0 for o in outs),
            "accepted": (stats.num_accepted_tokens - accepted0) if stats else 0,
            "drafted": (stats.num_draft_tokens - drafts0) if stats else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tiny", action="store_true", help="a small random model (checks the script)")
    parser.add_argument("--methods", default="ngram,draft_head")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens for ngram")
    parser.add_argument("--k-head", type=int, default=3, help="num_speculative_tokens for draft_head")
    parser.add_argument("--speculative-model", default=None, help="draft head weights (default: the shipped one)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0, help="also all prompts at once, in batches of this size")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample (seeded) at this temperature")
    parser.add_argument("--seed", type=int, default=1,
                        help="the requests' seed where --temperature > 0; -1: unseeded (outputs then differ by chance)")
    parser.add_argument("--out", default=f"bench/results/spec-decode-cpu-{datetime.date.today()}.json")
    args = parser.parse_args()

    from cluster import LLM, SamplingParams
    from cluster.models.draft_head import default_draft_head_path
    head_path = args.speculative_model
    model = args.model
    if args.tiny:
        model, head_path = tiny_model()
    max_tokens = 24 if args.tiny else args.max_tokens
    methods = ["none"] + [m for m in args.methods.split(",") if m]
    llms: dict[str, Any] = {}
    for m in methods:
        kw: dict[str, Any] = {}
        if m == "ngram":
            kw = {"speculative_method": "ngram", "num_speculative_tokens": args.k}
        elif m in ("draft_head", "draft_head_shipped", "draft_head_full_vocab", "draft_head_greedy_drafts"):
            kw = {"speculative_method": "draft_head", "num_speculative_tokens": args.k_head,
                  "speculative_model": default_draft_head_path("smollm2") if m == "draft_head_shipped" else head_path}
            if m == "draft_head_full_vocab":  # the head without its draft vocabulary
                kw["speculative_draft_vocab"] = "full"
            if m == "draft_head_greedy_drafts":
                kw["speculative_draft_sampling"] = "greedy"
        llms[m] = LLM(model, max_num_seqs=max(8, args.batch), **kw)
    seed = args.seed if args.temperature > 0 and args.seed >= 0 else None
    comparable = args.temperature == 0 or seed is not None  # an unseeded draw differs run to run
    params = SamplingParams(temperature=args.temperature, seed=seed, max_tokens=max_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for llm in llms.values():
        llm.chat([{"role": "user", "content": "hello"}], warm)

    def summarise(name: str, runs: list[dict[str, Any]], pooled: dict[str, list[float]]) -> dict[str, Any]:
        rates, steps_per = [], []
        for run in runs:
            n = sum(len(t) for t in run["tokens"])
            decode_s = run["seconds"] - run["first_token_s"]
            rates.append((n - len(run["tokens"])) / decode_s if decode_s > 0 else 0.0)
            steps_per.append((n - len(run["tokens"])) / max(1, run["steps"] - 1))
            pooled[name][0] += n - len(run["tokens"])
            pooled[name][1] += decode_s
            pooled[name][2] += max(1, run["steps"] - 1)
        row: dict[str, Any] = {"decode_tok_s_median": round(statistics.median(rates), 2),
                               "tokens_per_step_median": round(statistics.median(steps_per), 3),
                               "output_tokens": [sum(len(t) for t in r["tokens"]) for r in runs]}
        drafted = sum(r["drafted"] for r in runs)
        if name != "none":
            row["draft_acceptance"] = round(sum(r["accepted"] for r in runs) / drafted, 3) if drafted else 0.0
        return row

    rows: dict[str, Any] = {}
    pooled = {m: [0.0, 0.0, 0.0] for m in methods}  # tokens, decode seconds, steps
    turn = 0
    for cls, prompts in PROMPTS.items():
        per_method: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
        identical = True
        for prompt in prompts:
            for _ in range(args.rounds):
                order = methods[turn % len(methods):] + methods[:turn % len(methods)]
                turn += 1
                got = {m: run_one(llms[m], [prompt], params) for m in order}
                identical &= all(got[m]["tokens"] == got["none"]["tokens"] for m in methods)
                for m in methods:
                    per_method[m].append(got[m])
        row: dict[str, Any] = {"identical_tokens": identical}
        for m in methods:
            row[m] = summarise(m, per_method[m], pooled)
        for m in methods[1:]:
            row[f"speedup_{m}"] = round(row[m]["decode_tok_s_median"] / row["none"]["decode_tok_s_median"], 3)
        rows[cls] = row
        print(cls, row, flush=True)
    batch_rows: dict[str, Any] = {}
    if args.batch:
        everything = [p for ps in PROMPTS.values() for p in ps]
        batched = [everything[i:i + args.batch] for i in range(0, len(everything), args.batch)]
        walls: dict[str, list[float]] = {m: [] for m in methods}
        tokens: dict[str, int] = {}
        same = True
        for r in range(args.rounds):
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            got: dict[str, Any] = {}
            for m in order:
                runs = [run_one(llms[m], b, params) for b in batched]
                walls[m].append(sum(x["seconds"] for x in runs))
                got[m] = [t for x in runs for t in x["tokens"]]
                tokens[m] = sum(len(t) for t in got[m])
            same &= all(got[m] == got["none"] for m in methods)
        batch_rows = {"batch": args.batch, "identical_tokens": same,
                      **{m: {"output_tok_s_median": round(tokens[m] / statistics.median(walls[m]), 1),
                             "wall_s": [round(w, 3) for w in walls[m]]} for m in methods}}
        for m in methods[1:]:
            batch_rows[f"speedup_{m}"] = round(batch_rows[m]["output_tok_s_median"] / batch_rows["none"]["output_tok_s_median"], 3)
        print("batch", batch_rows, flush=True)
    pooled_rate = {m: v[0] / v[1] for m, v in pooled.items()}
    engines = {m: llm.engine for m, llm in llms.items()}
    result = {
        "bench": "spec_decode", "environment": environment(), "model": "tiny-random" if args.tiny else args.model,
        "batch": 1,
        "sampling": f"temperature {args.temperature}, seed {seed}" if args.temperature > 0 else "greedy", "max_tokens": max_tokens, "rounds": args.rounds,
        "methods": {m: {"num_speculative_tokens": e.model_config.num_speculative_tokens if m != "none" else 0,
                        **({"prompt_lookup": [e.model_config.prompt_lookup_min, e.model_config.prompt_lookup_max]}
                           if m == "ngram" else {}),
                        **({"speculative_model": e.model_config.speculative_model or "shipped",
                            "draft_vocab_size": _draft_vocab_size(e),
                            "draft_sampling": e.model_config.speculative_draft_sampling} if m.startswith("draft_head") else {})}
                    for m, e in engines.items()},
        "fast_paths": {"device": str(engines["none"].device),
                       "cuda_graphs_captured": {m: e.runner.graph_status.captured for m, e in engines.items()},
                       "pipelined_decode": {m: e._pipelined for m, e in engines.items()},
                       "pipelined_verify": {m: e._spec_pipelined or e.spec_pipeline_status
                                            for m, e in engines.items() if m != "none"},
                       "pipelined_verify_steps": {m: e.num_pipelined_verify_steps for m, e in engines.items()},
                       "verify_graph_steps": {m: e.runner.num_verify_graph_steps for m, e in engines.items()},
                       "sampled_verify_graph_steps": {m: e.runner.num_sampled_verify_graph_steps
                                                      for m, e in engines.items()},
                       "sampled_verify_graphs": {m: ("captured" if e.runner.verify_graphs.sampled_graphs
                                                     else "off") + (f": {e.runner.verify_graphs.sampled_reason}"
                                                                    if e.runner.verify_graphs.sampled_reason else "")
                                                 for m, e in engines.items() if e.runner.verify_graphs is not None},
                       "pipelined_coupled_launches": {m: e.runner.num_noise_launches for m, e in engines.items()},
                       "pipelined_seeded_launches": {m: e.runner.num_seeded_launches for m, e in engines.items()},
                       "verify_graphs": {m: e.runner.verify_graph_status.describe() for m, e in engines.items()
                                         if m.startswith("draft_head")},
                       "sync_steps": {m: e.num_sync_steps for m, e in engines.items()},
                       "graph_steps": {m: e.runner.num_graph_steps for m, e in engines.items()},
                       "eager_steps": {m: e.runner.num_eager_steps for m, e in engines.items()},
                       "kernels": sorted({r["impl"] for r in engines["none"].backends() if r["component"] != "cuda_graphs"}),
                       "draft_head_pass": (engines["draft_head"].runner.drafter.graph_status.describe()
                                           if "draft_head" in engines else None),
                       "draft_head_proposals": ({"graph": engines["draft_head"].runner.drafter.num_graph_proposals,
                                                 "eager": engines["draft_head"].runner.drafter.num_eager_proposals,
                                                 "sampled_drafts": engines["draft_head"].runner.drafter.num_sampled_drafts}
                                                if "draft_head" in engines else None)},
        "anchor": "no speculation, the same engine settings, the methods' order rotating prompt by prompt",
        "classes": rows,
        "batched": batch_rows,
        "pooled": {**{f"{m}_decode_tok_s": round(pooled_rate[m], 2) for m in methods},
                   **{f"speedup_{m}": round(pooled_rate[m] / pooled_rate["none"], 3) for m in methods[1:]},
                   **{f"{m}_tokens_per_step": round(pooled[m][0] / pooled[m][2], 3) for m in methods}},
        "all_identical": (all(r["identical_tokens"] for r in rows.values()) and batch_rows.get("identical_tokens", True))
        if comparable else "unseeded sampling: not comparable",
    }
    if args.tiny:
        result["note"] = "tiny random model and head: checks the script, measures nothing"
    print(result["pooled"], "identical:", result["all_identical"])
    write_result(args.out, result)


if __name__ == "__main__":
    main()
