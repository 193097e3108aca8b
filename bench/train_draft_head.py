"""Train the draft head (speculative_method=draft_head, cluster/models/draft_head.py) for a
Llama-family model by self-distillation, in one bounded run (the H200: a few minutes).

1. Data: the model writes it itself, through our engine: chat replies (its chat template) to
   user turns built from task templates x topics, some over passages of this repository's docs
   and code (summarise, explain, edit, convert); plain completions of random spans of those
   files and of random word lists. Greedy for 40% of prompts, temperature 0.7 / 1.0 for the rest.
2. Training: for each sequence the target's final hidden states ``h`` and next-token
   distribution ``p`` (dense forward, no gradient); the head at position ``t`` reads the token
   ``x_t`` and ``h_{t-1}``. Loss: soft cross-entropy against ``p`` plus a smooth-L1 pull of the
   head's output ``g_t`` towards ``h_t``, over ``k`` chained passes (pass ``j`` reads the
   previous pass's ``g`` in place of ``h``, as chained drafting does), weighted 1, 0.8, 0.64, ...
   AdamW, warm-up then cosine over the time budget.
3. Evaluation on held-out greedy sequences: each pass's top-1 agreement with the target, and
   the tokens per verify step a k-chain would give (1 + c1 + c1 c2 + ...: a draft counts only if
   those before it were right), teacher-forced (the served acceptance is measured by
   bench/spec_decode.py and bench/spec_decode_gpu.py through the engine).

The weights (bf16 safetensors, with the target shape and the run's figures as metadata) go to
``--weights``; the run's record to ``--out``.

    python bench/train_draft_head.py --model <SmolLM2 .gguf> --weights <dir>/smollm2-135m-instruct.safetensors \
        --out bench/results/draft-head-train-h200-<date>.json
    python bench/train_draft_head.py --tiny      # CPU, seconds: checks the script end to end

A run takes about --gen-seconds (plus the round that passes it), start-up and loading (about 30 s
on an H200), --train-seconds and the evaluation (about 10 s): give its command that much room.
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import random
import re
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, median, write_result  # noqa: E402
from cluster.common.sampling_params import SamplingParams  # noqa: E402
from cluster.engine.llm import LLM  # noqa: E402
from cluster.models.draft_head import (LlamaDraftHead, default_draft_head_path, dense_hidden,  # noqa: E402
                                       head_metadata, load_draft_head)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOPICS = """photosynthesis; black holes; the French revolution; compound interest; sourdough bread; the water
cycle; volcanoes; machine learning; climate change; the immune system; chess openings; jazz music; the
Roman empire; electric cars; coffee brewing; plate tectonics; the stock market; vaccines; recycling;
gardening tomatoes; the moon landing; quantum computers; honey bees; marathon training; the internet;
renewable energy; ancient Egypt; the human heart; budgeting; learning a language; octopuses; rainbows;
sleep; the printing press; recursion; sorting algorithms; hash tables; HTTP; databases; caching;
operating systems; GPUs; time management; public speaking; job interviews; dinosaurs; the ocean; tea;
bicycles; friendship; mountains; the solar system; earthquakes; pizza; libraries; birds migrating;
the metric system; prime numbers; probability; fractions; a rainy day; a lost key; a robot chef;
a dragon who cannot fly; a lighthouse keeper; a time traveller; a small bakery; a space station""".replace("\n", " ")

TASKS = [
    "Explain {t} in simple terms.", "Write a short story about {t}.", "Give me five tips about {t}.",
    "What are the pros and cons of {t}?", "Write a poem about {t}.", "Summarise what you know about {t}.",
    "Write a haiku about {t}.", "Explain {t} to a ten-year-old.", "List three facts about {t}.",
    "Write an email to a friend about {t}.", "What is the history of {t}?", "Describe {t} in one paragraph.",
    "Compare {t} and {u}.", "Write a dialogue between two people about {t}.", "Why does {t} matter?",
    "Write a Python function related to {t}, with comments.", "Give a step-by-step guide to {t}.",
    "Write a blog post introduction about {t}.", "What questions should I ask about {t}?",
    "Make a numbered list of ideas about {t} and {u}.",
]
FILE_TASKS = [
    "Summarise the following text:\n\n{p}", "Explain what this code does:\n\n{p}",
    "Rewrite the following more clearly:\n\n{p}", "Convert the key points of this text to a JSON list:\n\n{p}",
    "Add a docstring to this code and repeat it:\n\n{p}", "What are the main ideas here?\n\n{p}",
    "Translate this to simple English:\n\n{p}", "Repeat this text, fixing any typos:\n\n{p}",
]
#: Tasks over a passage of code (a .py file, cut at line starts): edits that repeat most of it.
CODE_TASKS = [
    "Add type hints to this Python code and return the full code:\n\n{p}",
    "Add comments to this code and return all of it:\n\n{p}",
    "Rename the variable {v} to {w} in this code and return all of it:\n\n{p}",
    "Rewrite this code to be shorter and return it:\n\n{p}", "Write unit tests for this code:\n\n{p}",
    "Find a bug in this code, if any, and show the fixed code:\n\n{p}",
    "Convert this Python code to JavaScript:\n\n{p}", "Explain this code line by line:\n\n{p}",
]
#: Tasks over a passage of prose (a .md file, or a docstring-rich passage).
TEXT_TASKS = [
    "Summarise this passage in three sentences:\n\n{p}", "Rewrite this passage in simpler words:\n\n{p}",
    "Make a bulleted list of the key points of this text:\n\n{p}", "Give this text a title and a one-line "
    "summary:\n\n{p}", "Write three questions a reader might ask about this text, and answer them:\n\n{p}",
    "Rewrite this text as an email to a colleague:\n\n{p}",
]


#: Structured-data chats: a random table (markdown or CSV) or JSON list, then one of these.
DATA_TASKS = [
    "Convert this table to a JSON list of objects:\n\n{d}", "Write this data as a markdown table:\n\n{d}",
    "Which row has the largest {c}? Answer with the whole row.\n\n{d}", "Sort these rows by {c}:\n\n{d}",
    "Write each row of this data as one sentence:\n\n{d}", "Convert this to CSV with a header line:\n\n{d}",
    "Add a column with a short note for each row and show the whole table:\n\n{d}",
    "Summarise this data in a few sentences:\n\n{d}", "Write Python code that builds this data as a list of "
    "dicts:\n\n{d}", "Turn this data into YAML:\n\n{d}",
]
FIRST = "Alice Bruno Chen Dana Emil Farah Goran Hana Ivan Julia Kenji Lena Mateo Nora Omar Priya Quinn Rosa Sami Tara".split()
LAST = "Martin Costa Wei Levi Berg Khan Novak Sato Rossi Silva Kim Nguyen Haddad Jensen Park Okafor Moreau Dubois".split()
CITIES = "Lyon Porto Suzhou Haifa Malmo Lahore Osaka Lima Accra Quebec Tartu Cork Pune Bergen Perth Graz Kyoto Nice".split()
ITEMS = "apple kettle lamp bicycle notebook chair battery router jacket monitor helmet drill tent camera".split()
COLUMNS = {"name": lambda g: f"{g.choice(FIRST)} {g.choice(LAST)}", "city": lambda g: g.choice(CITIES),
           "age": lambda g: str(g.randint(18, 80)), "price": lambda g: f"{g.randint(1, 900)}.{g.randint(0, 99):02d}",
           "item": lambda g: g.choice(ITEMS), "score": lambda g: str(g.randint(0, 100)),
           "quantity": lambda g: str(g.randint(1, 50)),
           "date": lambda g: f"2026-{g.randint(1, 12):02d}-{g.randint(1, 28):02d}"}


def random_data(rng: random.Random) -> tuple[str, str]:
    """A random small table as markdown, CSV or a JSON list, and one of its numeric columns."""
    cols = ["id"] + rng.sample(sorted(COLUMNS), rng.randint(2, 4))
    rows = [[str(i + 1)] + [COLUMNS[c](rng) for c in cols[1:]] for i in range(rng.randint(3, 8))]
    numeric = [c for c in cols if c in ("age", "price", "score", "quantity")] or ["id"]
    style = rng.random()
    if style < 0.45:
        text = "\n".join(["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
                         + ["| " + " | ".join(r) + " |" for r in rows])
    elif style < 0.75:
        text = "\n".join([",".join(cols)] + [",".join(r) for r in rows])
    else:
        text = "[\n" + ",\n".join("  {" + ", ".join(f'"{c}": "{v}"' for c, v in zip(cols, r)) + "}" for r in rows) + "\n]"
    return text, rng.choice(numeric)


def corpus_files() -> list[str]:
    files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    files += sorted(glob.glob(os.path.join(ROOT, "cluster", "**", "*.py"), recursive=True))
    files += sorted(glob.glob(os.path.join(ROOT, "bench", "*.py")))
    return [f for f in files if os.path.getsize(f) > 200]


def build_prompts(tokenizer: Any, n: int, rng: random.Random, max_prompt: int,
                  data_share: float = 0.0) -> list[tuple[str, list[int]]]:
    """``n`` (kind, prompt token ids): chats over random tables and JSON (``data_share`` of them),
    chats from templates, chats over file passages, raw completions."""
    topics = [t.strip() for t in TOPICS.split(";") if t.strip()]
    files = [(f, open(f, encoding="utf-8", errors="replace").read()) for f in corpus_files()]
    texts = [t for _, t in files]
    words = sorted({w for t in texts for w in t.split() if w.isalpha() and 3 <= len(w) <= 10})
    out: list[tuple[str, list[int]]] = []
    while len(out) < n:
        r = rng.random()
        if r < data_share:
            data, column = random_data(rng)
            ids = tokenizer.encode_chat([{"role": "user", "content": rng.choice(DATA_TASKS).format(d=data, c=column)}])
            if len(ids) <= max_prompt:  # a cut table would be a malformed one: draw another
                out.append(("chat_data", ids))
            continue
        r = data_share + (r - data_share) / (1 - data_share)  # the rest as before
        if r < 0.5:
            msg = rng.choice(TASKS).format(t=rng.choice(topics), u=rng.choice(topics))
            out.append(("chat", tokenizer.encode_chat([{"role": "user", "content": msg}])))
        elif r < 0.75:
            path, text = rng.choice(files)
            start = rng.randrange(max(1, len(text) - 400))
            start = text.rfind("\n", 0, start) + 1  # passages start at a line
            passage = text[start:start + rng.randint(200, 1200)]
            u = rng.random()
            if u < 0.35:
                task = rng.choice(FILE_TASKS)
            elif path.endswith(".py"):
                task = rng.choice(CODE_TASKS)
            else:
                task = rng.choice(TEXT_TASKS)
            names = sorted(set(re.findall(r"\b[a-z_][a-z0-9_]{2,}\b", passage))) or ["value"]
            msg = task.format(p=passage, v=rng.choice(names), w=rng.choice(words).lower())
            ids = tokenizer.encode_chat([{"role": "user", "content": msg}])
            out.append(("chat_file", ids[-max_prompt:] if len(ids) > max_prompt else ids))
        elif r < 0.92:
            text = rng.choice(texts)
            start = rng.randrange(max(1, len(text) - 200))
            out.append(("completion_file", tokenizer.encode(text[start:start + rng.randint(40, 600)])[:max_prompt]))
        else:
            out.append(("completion_words", tokenizer.encode(" ".join(rng.choice(words) for _ in range(rng.randint(3, 24))))))
    return out


def generate(llm: LLM, prompts: list[tuple[str, list[int]]], rng: random.Random, max_new: int,
             max_len: int, seconds: float, round_size: int, greedy_fraction: float = 0.4,
             seeded: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    seqs: list[dict[str, Any]] = []
    t0, done, tokens = time.monotonic(), 0, 0
    while done < len(prompts) and time.monotonic() - t0 < seconds:
        batch = prompts[done:done + round_size]
        params = []
        for _ in batch:
            temp = 0.0 if rng.random() < greedy_fraction else rng.choice([0.7, 0.7, 1.0])
            seed = rng.randrange(1 << 30)  # drawn either way: the prompts' order stays the same
            params.append(SamplingParams(temperature=temp, top_p=0.95 if temp else 1.0, seed=seed if seeded else None,
                                         max_tokens=rng.randint(max_new // 3, max_new)))
        outs = llm.generate([ids for _, ids in batch], params)
        for (kind, ids), sp, o in zip(batch, params, outs):
            full = (ids + o.outputs[0].token_ids)[:max_len]
            tokens += len(o.outputs[0].token_ids)
            seqs.append({"kind": kind, "greedy": sp.temperature == 0.0, "ids": full, "prompt": len(ids)})
        done += len(batch)
    elapsed = time.monotonic() - t0
    return seqs, {"sequences": len(seqs), "generated_tokens": tokens, "seconds": round(elapsed, 1),
                  "generated_tok_s": round(tokens / elapsed, 1)}


def batches(seqs: list[dict[str, Any]], batch_tokens: int, rng: random.Random, pad: int):
    """Endless shuffled batches of similar-length sequences, right-padded: (ids [B, L], lengths [B],
    prompt lengths [B])."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]["ids"]))
    groups, cur, width = [], [], 0
    for i in order:
        n = len(seqs[i]["ids"])
        if cur and max(width, n) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    if cur:
        groups.append(cur)
    while True:
        rng.shuffle(groups)
        for g in groups:
            width = max(len(seqs[i]["ids"]) for i in g)
            ids = torch.full((len(g), width), pad, dtype=torch.long)
            for row, i in enumerate(g):
                ids[row, :len(seqs[i]["ids"])] = torch.tensor(seqs[i]["ids"])
            yield (ids, torch.tensor([len(seqs[i]["ids"]) for i in g]),
                   torch.tensor([seqs[i].get("prompt", 0) for i in g]))


def shift_right(x: torch.Tensor) -> torch.Tensor:
    """``x[:, t - 1]`` at ``t`` (zeros at 0): the hidden state the head reads at each position."""
    return torch.cat((torch.zeros_like(x[:, :1]), x[:, :-1]), dim=1)


def chain_losses(head: LlamaDraftHead, target: Any, lm_head: torch.Tensor, ids: torch.Tensor,
                 lengths: torch.Tensor, k: int, train: bool, prompts: torch.Tensor | None = None,
                 prompt_weight: float = 1.0) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """(loss, per pass the [B, L] bool of top-1 agreement with the target, the [B, L] mask of
    positions with a next token). Positions that predict a prompt token (``t < prompts - 1``)
    weigh ``prompt_weight`` in the loss: serving drafts only answers, though the head still
    reads the prompt (its KV) and learns from it."""
    with torch.no_grad():
        h = dense_hidden(target, ids)
        t_logits = F.linear(h, lm_head).float()
        p = t_logits.softmax(-1)
        t_top = t_logits.argmax(-1)
        del t_logits
        embeds = target.embed_tokens(ids)
    pos = torch.arange(ids.shape[1], device=ids.device)[None, :]
    mask = (pos < (lengths[:, None] - 1)).float()
    weight = mask
    if prompts is not None and prompt_weight != 1.0:
        weight = mask * torch.where(pos < (prompts[:, None] - 1), prompt_weight, 1.0)
    denom = weight.sum().clamp(min=1.0)
    hidden_in = shift_right(h)
    loss = torch.zeros((), device=ids.device)
    agree = []
    for j in range(k):
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
            g = head.forward_dense(embeds.to(head.fc.weight.dtype), hidden_in.to(head.fc.weight.dtype))
            logits = F.linear(g.to(lm_head.dtype), lm_head).float()
        ce = -(p * logits.log_softmax(-1)).sum(-1)
        reg = F.smooth_l1_loss(g.float(), h.float(), reduction="none").mean(-1)
        loss = loss + (0.8 ** j) * ((ce + 0.5 * reg) * weight).sum() / denom
        agree.append((logits.argmax(-1) == t_top) & mask.bool())
        hidden_in = shift_right(g if train else g.detach())
    return loss, agree, mask.bool()


def tokens_per_step(agree: list[torch.Tensor], mask: torch.Tensor) -> dict[str, Any]:
    """Teacher-forced: from each start position n, draft j (made at position n + j - 1 by pass j)
    counts if it and every draft before it agree with the target."""
    k, length = len(agree), mask.shape[1]
    run = torch.ones_like(mask[:, :length - k + 1], dtype=torch.bool)
    accepted = torch.zeros_like(run, dtype=torch.float32)
    valid = mask[:, k - 1:]
    for j in range(k):
        run = run & agree[j][:, j:length - k + 1 + j]
        accepted += run.float()
    pos_rate = [float(agree[j][mask].float().mean()) for j in range(k)]
    return {"tokens_per_step": 1.0 + float(accepted[valid].mean()) if valid.any() else 1.0,
            "top1_agreement_per_pass": [round(x, 4) for x in pos_rate]}


def answer_tokens_per_step(agree: list[torch.Tensor], mask: torch.Tensor, prompt_len: int) -> float | None:
    """``tokens_per_step`` over the positions that predict the answer's tokens only (serving
    drafts answers; the prompt's positions are prefilled), or None where too few of them."""
    answer = mask.clone()
    answer[:, :max(0, prompt_len - 1)] = False
    if not answer[:, len(agree) - 1:].any():
        return None
    return tokens_per_step(agree, answer)["tokens_per_step"]


def bench_prompt_eval(llm: LLM, heads: dict[str, LlamaDraftHead], target: Any, lm_head: torch.Tensor, k: int,
                      dev: torch.device, max_tokens: int = 160) -> dict[str, Any]:
    """Teacher-forced tokens per step on the answers the target gives greedily to the served
    benchmark's prompts (bench/spec_decode.py's classes; never in the training data): the figure
    closest to what bench/spec_decode_gpu.py will measure through the engine. One row per head in
    ``heads`` (the new one, and the committed one to compare)."""
    from bench.spec_decode import PROMPTS
    names = [c for c, ps in PROMPTS.items() for _ in ps]
    outs = llm.chat([[{"role": "user", "content": p}] for ps in PROMPTS.values() for p in ps],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens))
    result: dict[str, Any] = {}
    for label, head in heads.items():
        per: dict[str, list[float]] = {}
        for name, o in zip(names, outs):
            prompt = list(o.prompt_token_ids)
            ids = torch.tensor([prompt + list(o.outputs[0].token_ids)], device=dev)
            _, agree, mask = chain_losses(head, target, lm_head, ids, torch.tensor([ids.shape[1]], device=dev), k,
                                          train=False)
            got = answer_tokens_per_step(agree, mask, len(prompt))
            if got is not None:
                per.setdefault(name, []).append(got)
        row = {c: round(sum(v) / len(v), 3) for c, v in per.items()}
        row["mean"] = round(sum(x for v in per.values() for x in v) / max(1, sum(len(v) for v in per.values())), 3)
        result[label] = row
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--target-name", default="SmolLM2-135M-Instruct")
    ap.add_argument("--weights", default=None, help="where to write the head (safetensors)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=12000)
    ap.add_argument("--max-new", type=int, default=384)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--gen-seconds", type=float, default=170)
    ap.add_argument("--train-seconds", type=float, default=260)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--round-size", type=int, default=512,
                    help="prompts per generate call: generation stops after the round that passes --gen-seconds")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--greedy-fraction", type=float, default=0.4, help="prompts answered greedily (the rest sampled)")
    ap.add_argument("--seeded", action=argparse.BooleanOptionalAction, default=True,
                    help="seeded sampling (reproducible data; slower: a generator per row and step)")
    ap.add_argument("--data-share", type=float, default=0.0, help="chats over random tables and JSON")
    ap.add_argument("--baseline-head", default=default_draft_head_path("smollm2"),
                    help="a head to evaluate beside the new one on the benchmark's prompts (default: the committed one)")
    ap.add_argument("--prompt-weight", type=float, default=1.0,
                    help="loss weight of positions that predict prompt tokens (answers weigh 1)")
    ap.add_argument("--kv-cache-gib", type=int, default=6, help="the generating engine's KV (the rest is training's)")
    ap.add_argument("--data", default=None, help="generated sequences: read if there, else written")
    ap.add_argument("--tiny", action="store_true", help="CPU, seconds: checks the script end to end")
    args = ap.parse_args()
    if args.tiny:
        args.prompts, args.max_new, args.max_len, args.gen_seconds, args.train_seconds = 24, 24, 160, 60, 15
        args.batch_tokens, args.round_size, args.max_num_seqs = 1024, 12, 12
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    started = time.monotonic()
    llm = LLM(args.model, device=device, dtype="bfloat16" if device == "cuda" else "float32",
              max_model_len=args.max_len + 8, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192,
              enable_prefix_caching=True, seed=args.seed,
              kv_cache_memory_bytes=args.kv_cache_gib << 30 if device == "cuda" else None)
    target = llm.engine.model
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None
    prompts = build_prompts(tokenizer, args.prompts, rng, max_prompt=args.max_len // 2, data_share=args.data_share)
    if args.data and os.path.exists(args.data):
        seqs, gen = torch.load(args.data)
    else:
        seqs, gen = generate(llm, prompts, rng, args.max_new, args.max_len, args.gen_seconds, args.round_size,
                             args.greedy_fraction, args.seeded)
        gen.update(greedy_fraction=args.greedy_fraction, seeded=args.seeded, data_share=args.data_share,
                   prompts_built=len(prompts))
        if args.data:
            torch.save((seqs, gen), args.data)
    print("generated", gen, flush=True)
    seqs = [s for s in seqs if len(s["ids"]) >= 8]
    rng.shuffle(seqs)
    greedy = [s for s in seqs if s["greedy"]]
    held = greedy[:max(2, len(seqs) // 25)]
    held_ids = {id(s) for s in held}
    train = [s for s in seqs if id(s) not in held_ids]

    dev = torch.device(device)
    lm_head = (target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight).detach()
    head = LlamaDraftHead(target.args, target.args.num_layers, torch.float32).to(dev)
    head.init_from_target(target)
    params = [p for p in head.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    pad = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
    data = batches(train, args.batch_tokens, rng, pad)
    t0, step, losses, step_times = time.monotonic(), 0, [], []
    warmup = 30
    while time.monotonic() - t0 < args.train_seconds:
        frac = (time.monotonic() - t0) / args.train_seconds
        lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        for group in opt.param_groups:
            group["lr"] = lr
        ids, lengths, prompt_lens = next(data)
        ts = time.monotonic()
        loss, _, _ = chain_losses(head, target, lm_head, ids.to(dev), lengths.to(dev), args.k, train=True,
                                  prompts=prompt_lens.to(dev), prompt_weight=args.prompt_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step_times.append(time.monotonic() - ts)
        if step % 50 == 0:
            print(f"step {step} loss {losses[-1]:.4f} lr {lr:.2e} t {time.monotonic() - t0:.0f}s", flush=True)
        step += 1
    for p in params:
        p.requires_grad_(False)
    evals: dict[str, Any] = {}
    with torch.no_grad():
        stats, outputs = [], []
        for s in held:
            ids = torch.tensor([s["ids"]], device=dev)
            _, agree, mask = chain_losses(head, target, lm_head, ids, torch.tensor([ids.shape[1]], device=dev),
                                          args.k, train=False)
            stats.append(tokens_per_step(agree, mask))
            got = answer_tokens_per_step(agree, mask, s.get("prompt", 0))
            if got is not None:
                outputs.append(got)
        evals = {"held_out_greedy_sequences": len(held),
                 # what serving sees: drafts of the answer only (the prompt's positions are prefilled)
                 "answer_tokens_per_step_k%d_mean" % args.k: round(sum(outputs) / max(1, len(outputs)), 3),
                 "tokens_per_step_k%d_median" % args.k: round(median([x["tokens_per_step"] for x in stats]), 3),
                 "tokens_per_step_k%d_mean" % args.k: round(sum(x["tokens_per_step"] for x in stats) / len(stats), 3),
                 "top1_agreement_per_pass_mean": [round(sum(x["top1_agreement_per_pass"][j] for x in stats) / len(stats), 4)
                                                  for j in range(args.k)]}
        heads = {"trained": head}
        if args.baseline_head and os.path.isfile(args.baseline_head):
            heads["baseline"] = load_draft_head(args.baseline_head, target, target.args.num_layers, torch.float32, dev)
        evals["bench_prompts_answer_tokens_per_step"] = bench_prompt_eval(
            llm, heads, target, lm_head, args.k, dev, max_tokens=24 if args.tiny else 160)
    print("eval", evals, flush=True)
    training = {"steps": step, "seconds": round(time.monotonic() - t0, 1), "train_sequences": len(train),
                "train_tokens": sum(len(s["ids"]) for s in train), "k": args.k, "lr": args.lr,
                "batch_tokens": args.batch_tokens, "loss_first": round(losses[0], 4) if losses else None,
                "loss_last_50_median": round(median(losses[-50:]), 4) if losses else None,
                "step_ms_median": round(1000 * median(step_times), 1) if step_times else None,
                "parameters": sum(p.numel() for p in params)}
    env = environment()
    if args.weights:
        from safetensors.torch import save_file
        os.makedirs(os.path.dirname(os.path.abspath(args.weights)), exist_ok=True)
        state = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in head.state_dict().items()}
        save_file(state, args.weights, metadata=head_metadata(
            target.args, args.target_name, commit=env.get("commit", ""), device=env.get("device", ""),
            training=training, eval=evals))
        print("wrote", args.weights, flush=True)
    result = {"environment": env, "target": args.target_name, "generation": gen, "training": training,
              "eval_teacher_forced": evals, "kinds": {k: sum(1 for s in seqs if s["kind"] == k)
                                                      for k in sorted({s["kind"] for s in seqs})},
              "wall_s": round(time.monotonic() - started, 1)}
    if args.out:
        write_result(args.out, result)
    print(result)


if __name__ == "__main__":
    main()
