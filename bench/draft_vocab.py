"""The draft head's vocabulary: the tokens a model writes most, counted on text it writes itself.

A draft head predicts the target's next token through the target's LM head; over SmolLM2's 49,152
tokens that product is most of a draft pass on a CPU (the int8 logits rows, 28 MB, against the
head's layer). Drafting over the tokens the model actually writes costs a sixth of that and loses
only the drafts whose token lies outside them (a draft is a proposal: the target's verify step
decides every token, so output never changes; acceptance does, by at most the share of answer
tokens outside the set).

The run generates answers through our engine to the prompts the head's training script builds
(``bench/train_draft_head.py``: chats from templates, tasks over this repository's files,
tables and JSON, completions; greedy and sampled), counts the answer tokens (not the prompts')
of nine sequences in ten, ranks tokens by count (ties by id) and measures how much of the tenth
(held out) and of the greedy answers to the served benchmark's prompts (``bench/spec_decode.py``,
never counted) each vocabulary size covers. The ``--size`` most frequent ids go to ``--vocab``
(safetensors: ``token_ids`` int64, most frequent first; loaded next to the head it is named
after, ``cluster/models/draft_head.py``), the record to ``--out``.

    python bench/draft_vocab.py --model <SmolLM2 .gguf> --size 8192 \
        --vocab <dir>/smollm2-135m-instruct.vocab.safetensors --out bench/results/draft-vocab-h200-<date>.json
    python bench/draft_vocab.py --tiny      # CPU, seconds: checks the script end to end
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, write_result  # noqa: E402
from bench.spec_decode import PROMPTS  # noqa: E402
from bench.train_draft_head import build_prompts, generate  # noqa: E402
from cluster.common.sampling_params import SamplingParams  # noqa: E402
from cluster.engine.llm import LLM  # noqa: E402
from cluster.models.draft_head import VOCAB_FORMAT  # noqa: E402

SIZES = (1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768)


def coverage(ranked: list[int], counts: collections.Counter, sizes: tuple[int, ...]) -> dict[str, float]:
    """Share of the tokens ``counts`` holds whose id is among the first ``n`` of ``ranked``."""
    total = sum(counts.values())
    rank = {t: i for i, t in enumerate(ranked)}
    out = {}
    for n in sizes:
        inside = sum(c for t, c in counts.items() if rank.get(t, n) < n)
        out[str(n)] = round(inside / total, 5) if total else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--target-name", default="SmolLM2-135M-Instruct")
    ap.add_argument("--size", type=int, default=8192, help="ids written to --vocab")
    ap.add_argument("--vocab", default=None, help="where to write the vocabulary (safetensors)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--prompts", type=int, default=20000)
    ap.add_argument("--max-new", type=int, default=384)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--gen-seconds", type=float, default=150)
    ap.add_argument("--round-size", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--data-share", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=1, help="not the head's training seed: other prompts")
    ap.add_argument("--kv-cache-gib", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="CPU, seconds: checks the script end to end")
    args = ap.parse_args()
    if args.tiny:
        args.prompts, args.max_new, args.max_len, args.gen_seconds = 16, 24, 160, 60
        args.round_size, args.max_num_seqs, args.size = 8, 8, 512
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = random.Random(args.seed)
    llm = LLM(args.model, device=device, dtype="bfloat16" if device == "cuda" else None,
              max_model_len=args.max_len + 8, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192,
              seed=args.seed, kv_cache_memory_bytes=args.kv_cache_gib << 30 if device == "cuda" else None)
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None
    vocab_size = int(llm.engine.model.args.vocab_size)
    prompts = build_prompts(tokenizer, args.prompts, rng, max_prompt=args.max_len // 2, data_share=args.data_share)
    seqs, gen = generate(llm, prompts, rng, args.max_new, args.max_len, args.gen_seconds, args.round_size,
                         seeded=False)
    print("generated", gen, flush=True)
    counted: collections.Counter = collections.Counter()
    held: collections.Counter = collections.Counter()
    for i, s in enumerate(seqs):
        (held if i % 10 == 9 else counted).update(s["ids"][s["prompt"]:])
    # the served benchmark's prompts, greedy: what bench/spec_decode.py drafts
    bench_msgs = [[{"role": "user", "content": p}] for ps in PROMPTS.values() for p in ps]
    outs = llm.chat(bench_msgs, SamplingParams(temperature=0.0, max_tokens=args.max_new))
    served: collections.Counter = collections.Counter(t for o in outs for t in o.outputs[0].token_ids)
    ranked = [t for t, _ in sorted(counted.items(), key=lambda kv: (-kv[1], kv[0]))]
    seen = len(ranked)
    ranked += [t for t in range(vocab_size) if t not in counted]  # never seen: by id, after the rest
    sizes = tuple(n for n in SIZES if n < vocab_size) + (args.size,)
    sizes = tuple(sorted(set(sizes)))
    size = min(args.size, vocab_size)
    chosen = ranked[:size]
    missing = [eos for eos in tokenizer.eos_token_ids or [] if eos not in chosen]
    if missing:  # the end of an answer is always draftable: in place of the rarest
        chosen[size - len(missing):] = missing
    result: dict[str, Any] = {
        "bench": "draft_vocab", "environment": environment(), "device": device,
        "target": args.target_name, "vocab_size": vocab_size, "size": size,
        "generation": gen, "counted_answer_tokens": sum(counted.values()),
        "held_out_answer_tokens": sum(held.values()), "served_bench_answer_tokens": sum(served.values()),
        "distinct_tokens_counted": seen,
        "coverage_held_out": coverage(ranked, held, sizes),
        "coverage_served_bench": coverage(ranked, served, sizes),
        "args": vars(args),
    }
    if args.vocab:
        from safetensors.torch import save_file
        os.makedirs(os.path.dirname(os.path.abspath(args.vocab)) or ".", exist_ok=True)
        meta = {"format": VOCAB_FORMAT, "target": args.target_name, "vocab_size": str(vocab_size),
                "counted_answer_tokens": str(result["counted_answer_tokens"]),
                "coverage_held_out": str(result["coverage_held_out"][str(size)]),
                "coverage_served_bench": str(result["coverage_served_bench"][str(size)]),
                "commit": str(result["environment"].get("commit"))}
        save_file({"token_ids": torch.tensor(chosen, dtype=torch.int64)}, args.vocab, metadata=meta)
        print("wrote", args.vocab)
    print({k: result[k] for k in ("size", "counted_answer_tokens", "coverage_held_out", "coverage_served_bench")})
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
