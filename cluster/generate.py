"""Command line offline generation:
``python -m cluster.generate --model smollm2 --prompt "..." [--max-tokens N --temperature T --seed S --json]``."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from cluster.common.errors import ClusterError
from cluster.common.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cluster.generate", description=__doc__)
    parser.add_argument("--model", default="smollm2", help="HF directory, .gguf file, or 'smollm2'")
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text (repeat for a batch)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cluster.engine.llm import LLM

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        start = time.perf_counter()
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outputs = llm.generate(args.prompt, params)
        elapsed = time.perf_counter() - start
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outputs):
        completion = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": completion.text, "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason,
                              "prompt_tokens": len(out.prompt_token_ids), "seconds": round(elapsed, 3)}))
        else:
            print(completion.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
