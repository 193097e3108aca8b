"""Offline engine benchmark on the embedded default model (SmolLM2-135M-Instruct, GGUF) against
HuggingFace transformers ``generate`` on the same weights, in the same run.

For each batch size: end-to-end throughput (generated tokens / wall time of ``LLM.generate`` for
the whole batch, prefill included) and per-token decode latency (median time of one engine step
once every request is decoding). transformers: the same prompts, padded left, greedy
``generate`` with the same number of new tokens; its per-token latency is (time for N+1 new
tokens - time for 1 new token) / N.

    python bench/engine.py --out bench/results/engine-cpu-<date>.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, median  # noqa: E402
from cluster import LLM, SamplingParams  # noqa: E402
from cluster.models.registry import resolve_model_path  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint. Describe the colors it sees."


def bench_ours(llm: LLM, batch: int, new_tokens: int, repeats: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompts = [f"{i}. {PROMPT}" for i in range(batch)]
    llm.generate(prompts[:1], params.replace(max_tokens=4))  # warm-up
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        walls.append(time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    # per-token decode latency: time engine steps once all requests are past their prefill
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"lat-{batch}-{i}", p, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if all(g.samples[0].num_output_tokens > 0 for g in engine.groups.values()):
            steps.append(elapsed)
    wall = median(walls)
    return {"throughput_tok_s": batch * new_tokens / wall, "wall_s": wall,
            "decode_step_ms": 1000 * median(steps[1:-1] or steps)}


def bench_hf(model, tokenizer, batch: int, new_tokens: int, repeats: int) -> dict[str, float]:
    prompts = [f"{i}. {PROMPT}" for i in range(batch)]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        assert out.shape[1] - inputs["input_ids"].shape[1] == n
        return time.perf_counter() - start

    run(2)  # warm-up
    walls = [run(new_tokens) for _ in range(repeats)]
    firsts = [run(1) for _ in range(repeats)]
    wall = median(walls)
    return {"throughput_tok_s": batch * new_tokens / wall, "wall_s": wall,
            "decode_step_ms": 1000 * (wall - median(firsts)) / (new_tokens - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=f"bench/results/engine-cpu-{datetime.date.today()}.json")
    parser.add_argument("--no-hf", action="store_true")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM("smollm2", max_num_seqs=max(batches), max_num_batched_tokens=4096)
    results: dict[str, object] = {"benchmark": "engine-offline", "model": "SmolLM2-135M-Instruct (GGUF Q4_1, "
                                  "dequantized to float32)", "new_tokens": args.new_tokens,
                                  "repeats": args.repeats, "environment": environment(), "rows": []}
    hf = tok = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        directory, name = os.path.split(resolve_model_path("smollm2"))
        hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    rows = []
    for batch in batches:
        row: dict[str, object] = {"batch": batch, "ours": bench_ours(llm, batch, args.new_tokens, args.repeats)}
        if hf is not None:
            row["transformers"] = bench_hf(hf, tok, batch, args.new_tokens, args.repeats)
            row["throughput_ratio"] = row["ours"]["throughput_tok_s"] / row["transformers"]["throughput_tok_s"]  # type: ignore[index]
        rows.append(row)
        print(json.dumps(row))
    results["rows"] = rows
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"{'batch':>5} {'ours tok/s':>11} {'hf tok/s':>9} {'ratio':>6} {'ours ms/step':>13} {'hf ms/step':>11}")
    for row in rows:
        ours, theirs = row["ours"], row.get("transformers", {})
        print(f"{row['batch']:>5} {ours['throughput_tok_s']:>11.1f} {theirs.get('throughput_tok_s', float('nan')):>9.1f} "
              f"{row.get('throughput_ratio', float('nan')):>6.2f} {ours['decode_step_ms']:>13.1f} "
              f"{theirs.get('decode_step_ms', float('nan')):>11.1f}")


if __name__ == "__main__":
    main()
