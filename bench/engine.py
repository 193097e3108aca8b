"""Offline engine benchmark on the embedded default model (SmolLM2-135M-Instruct, GGUF) against
HuggingFace transformers ``generate`` on the same weights, in the same run.

For each batch size: end-to-end throughput (generated tokens / wall time of ``LLM.generate`` for
the whole batch, prefill included) and per-token decode latency (median time of one engine step
once every request is decoding). transformers: the same prompts, padded left, greedy
``generate`` with the same number of new tokens; its per-token latency is (time for N+1 new
tokens - time for 1 new token) / N.

Two paths of ours: the default on a CPU (the file's Q4_1 projections kept 4-bit, the Q8_0
logits projection int8: cluster.models.cpu_quant; decode-only steps through the lean decode step,
cluster.models.llama_cpu_decode: ``fast_paths`` counts its steps) and ``dtype="float32"`` (everything
dequantized; the transformers anchor is on these same float32 weights). llama.cpp
(``llama-cpp-python``, when installed: skipped with a note otherwise) runs the same GGUF file,
one request at a time, with as many threads as torch. Served: ``--serve-concurrency`` (32) clients in
flight against the plain OpenAI server over the same default engine (streamed, greedy, the same new
tokens), its output tok/s beside llama.cpp's sequential rate. Also: start-up to the first token, the
weight bytes a decode step reads and the copy bandwidth measured here (their ratio is the
batch-1 roofline), and how many greedy tokens each path agrees on with the others.

    python bench/engine.py --out bench/results/engine-cpu-<date>.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, median  # noqa: E402
from cluster import LLM, SamplingParams  # noqa: E402
from kernels import cpu_native  # noqa: E402
from cluster.models.layers import Linear  # noqa: E402
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
    wall = median(walls)
    return {"throughput_tok_s": batch * new_tokens / wall, "wall_s": wall,
            "decode_step_ms": decode_step_ms(llm, prompts, params, f"lat-{batch}")}


def decode_step_ms(llm: LLM, prompts: Sequence[str | list[int]], params: SamplingParams, tag: str) -> float:
    """Per-token decode latency: the median of the engine's steps once every request is past its
    prefill (the first and last such step left out), all ``prompts`` in one batch."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if all(g.samples[0].num_output_tokens > 0 for g in engine.groups.values()):
            steps.append(elapsed)
    return 1000 * median(steps[1:-1] or steps)


def prefill_step_ms(llm: LLM, prompt: str | list[int], tag: str) -> tuple[float, int]:
    """The step that computes ``prompt`` whole, alone (the engine's first step for it), and the
    prompt's tokens."""
    engine = llm.engine
    engine.add_request(tag, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    tokens = len(engine.groups[tag].prompt_token_ids)
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * elapsed, tokens


def mixed_step_ms(llm: LLM, decoding: Sequence[str | list[int]], prompt: str | list[int],
                  params: SamplingParams, tag: str) -> tuple[float, float]:
    """A step that carries a prompt's chunk beside ``len(decoding)`` decoding requests: the median
    time of such steps and of their prompt tokens (the chunk is the LLM's cap), timed once every
    decoding request is past its prefill; steps where fewer were decoding do not count. The
    requests are run to their end afterwards. On a GPU each step is waited for (a step that
    samples nothing would be timed at its launch): its time is then the device's and the host's
    in turn, where a served replica overlaps them."""
    engine = llm.engine
    decoders = []
    for i, p in enumerate(decoding):
        engine.add_request(f"{tag}-d{i}", p, params)
        decoders.append(engine.groups[f"{tag}-d{i}"].samples[0])
    while any(d.num_output_tokens == 0 for d in decoders):
        engine.step()
    engine.add_request(f"{tag}-p", prompt, params.replace(max_tokens=1))
    chunked = engine.groups[f"{tag}-p"].samples[0]
    steps, tokens = [], []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    while chunked.num_output_tokens == 0:
        before = chunked.num_computed_tokens
        full = not any(d.status.finished for d in decoders)
        start = time.perf_counter()
        engine.step()
        sync()  # a chunk step with nothing to sample returns at its launch: time the device's work
        elapsed = time.perf_counter() - start
        if chunked.num_computed_tokens > before and full:
            steps.append(elapsed)
            tokens.append(chunked.num_computed_tokens - before)
    while engine.has_unfinished_requests():
        engine.step()
    if not steps:
        raise RuntimeError(f"{tag}: the decoding requests ended before the prompt's first chunk")
    # the steps whose chunk the cap bounded (the prompt's last chunk is its remainder), where any were
    bounded = [i for i, n in enumerate(tokens) if n == max(tokens)]
    return 1000 * median([steps[i] for i in bounded]), float(max(tokens))


def collect() -> None:
    """Free a deleted engine's memory before the next is built (its KV cache is a GPU's share,
    held by the engine's reference cycles until they are collected)."""
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def step_table_prompts(batches: Sequence[int], chunk_caps: Sequence[int], prefill_prompts: int) -> int:
    """The prompts ``step_table`` uses: the widest batch's, one chunked beside each batch (and
    none) at each cap, and the whole ones."""
    return max(batches) + len(chunk_caps) * (len(batches) + 1) + prefill_prompts


def step_table(make_llm: Callable[..., LLM], prompts: Sequence[str | list[int]], batches: Sequence[int],
               chunk_caps: Sequence[int], prefill_prompts: int, new_tokens: int) -> dict[str, Any]:
    """A served replica's step costs, for the simulator to price its steps with (``replica_steps``
    of ``bench/serve_compare.py`` on the CPU, ``bench/serve_gpu.py`` on a GPU): decode-only steps
    by batch (``decode_step_ms``) on the first ``max(batches)`` prompts; steps carrying a prompt
    chunk beside 0 .. each batch of decoding requests at each of ``chunk_caps`` (``mixed_step_ms``:
    two caps give each batch's fixed cost and cost per prompt token; the chunked prompts are ones
    no earlier step used, so no prefix-cache hits); and up to ``prefill_prompts`` of the prompts
    left, each whole, alone (``prefill_step_ms``). ``make_llm(**settings)`` builds the engine as the replica runs it, with
    ``max_num_seqs`` and, for the mixed steps, ``long_prefill_token_threshold`` set here."""
    widest = max(batches)
    needed = step_table_prompts(batches, chunk_caps, 1)  # and up to prefill_prompts - 1 more
    if len(prompts) < needed:
        raise ValueError(f"step_table needs {needed} prompts for batches {list(batches)}, got {len(prompts)}")
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    longest = max(len(p) if isinstance(p, list) else 0 for p in prompts)

    def warm_llm(**settings: Any) -> LLM:
        llm = make_llm(**settings)
        llm.generate(list(prompts[:1]), params.replace(max_tokens=4))  # warm-up
        return llm

    llm = warm_llm(max_num_seqs=widest)
    rows = [{"batch": b, "decode_step_ms": decode_step_ms(llm, prompts[:b], params, f"steps-{b}")} for b in batches]
    tokenizer = llm.get_tokenizer()
    if tokenizer is not None:  # the longest prompt in tokens: the decoders must outlive its chunks
        longest = max(len(p) if isinstance(p, list) else len(tokenizer.encode(p)) for p in prompts)
    del llm
    collect()
    mixed = []
    spare = iter(reversed(range(widest, len(prompts))))  # prompts no step above used
    for cap in chunk_caps:
        llm = warm_llm(max_num_seqs=widest + 1, long_prefill_token_threshold=cap)
        decode_params = params.replace(max_tokens=-(-longest // cap) + 8)
        for b in [0, *batches]:
            step_ms, tokens = mixed_step_ms(llm, prompts[:b], prompts[next(spare)], decode_params, f"mixed-{cap}-{b}")
            mixed.append({"batch": b, "chunk_cap": cap, "step_ms": step_ms, "prompt_tokens": tokens})
        del llm
        collect()
    llm = warm_llm(max_num_seqs=widest)  # a prefill replica's steps: a prompt whole, alone
    prefill = []
    for i in list(spare)[:prefill_prompts]:
        step_ms, tokens = prefill_step_ms(llm, prompts[i], f"prefill-{i}")
        prefill.append({"prompt_tokens": tokens, "step_ms": step_ms})
    del llm
    collect()
    print("replica steps (ms):", {r["batch"]: round(r["decode_step_ms"], 1) for r in rows},
          "with a prompt chunk:", {(r["batch"], r["prompt_tokens"]): round(r["step_ms"], 1) for r in mixed},
          "a prompt alone:", {r["prompt_tokens"]: round(r["step_ms"], 1) for r in prefill})
    return {"new_tokens": new_tokens, "rows": rows, "mixed": mixed, "prefill": prefill}


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


CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Tell me about Paris."}]]


def copy_bandwidth_gb_s(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Read + write bandwidth of a large tensor copy on this machine (median), GB/s counted as
    the bytes read (what a decode step's weight reads compare with)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / median(times[1:]) / 1e9


def weight_bytes_per_token(llm: LLM) -> int:
    """Bytes of weights a batch-1 decode step reads (projections and the logits projection; the
    embedding row and the norms are negligible)."""
    model = llm.engine.model
    total = 0
    for module in model.modules():
        quantized = getattr(module, "quantized", None)
        if quantized is not None:
            total += quantized.nbytes
        elif isinstance(module, Linear):
            total += module.weight.numel() * module.weight.element_size()
    if getattr(model, "quantized_logits", None) is not None:
        total += model.quantized_logits.nbytes
    elif model.lm_head is None:
        total += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def bench_serving(concurrency: int, new_tokens: int, prompt_tokens: int, port: int) -> dict[str, object]:
    """``concurrency`` clients in flight against the plain OpenAI server (``cluster.local_server``:
    one engine with the default settings, no Ray), streaming, greedy, ``new_tokens`` each, twice as
    many requests as clients: output tok/s through the whole served path (tokenizer, scheduler,
    detokenizer, HTTP), to set beside llama.cpp's one-at-a-time rate."""
    from bench.serve import BenchConfig, run_benchmark
    from bench.serve_compare import first_completion, start, stop, wait_healthy
    url = f"http://127.0.0.1:{port}"
    proc = start("local", "smollm2", port, "local")
    try:
        wait_healthy(url, proc)
        model = first_completion(url, proc)
        result = run_benchmark(BenchConfig(base_url=url, model=model, num_requests=2 * concurrency,
                                           concurrency=concurrency, input_len=prompt_tokens, output_len=new_tokens,
                                           ttft_target_s=2.0, itl_target_s=0.25, warmup=2,
                                           label=f"local-{concurrency}"))
    finally:
        stop(proc)
    return {"server": "cluster.local_server (the OpenAI server over one engine, no Ray), streamed",
            "concurrency": concurrency, "completed": result["completed"], "failed": result["failed"],
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "output_tok_s": result["output_token_throughput_tps"],
            "ttft_p50_s": result["ttft_s"]["p50"], "itl_p50_s": result["itl_s"]["p50"]}


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_ids(llm: LLM, prompt_ids: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return list(llm.generate([prompt_ids], params)[0].outputs[0].token_ids)


def llama_cpp_anchor(new_tokens: int, repeats: int, prompt_ids: list[int]) -> dict[str, object]:
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        return {"skipped": f"llama-cpp-python is not installed ({exc})"}
    llama = Llama(model_path=resolve_model_path("smollm2"), n_threads=torch.get_num_threads(), n_ctx=2048,
                  verbose=False, seed=0)

    def run(ids: list[int], n: int) -> tuple[list[int], float]:
        llama.reset()
        out: list[int] = []
        start = time.perf_counter()
        for token in llama.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if len(out) == n:
                break
        return out, time.perf_counter() - start

    run(prompt_ids, 4)
    walls = [run(prompt_ids, new_tokens)[1] for _ in range(repeats)]
    import llama_cpp
    return {"version": llama_cpp.__version__, "threads": torch.get_num_threads(),
            "batch1_tok_s": new_tokens / median(walls), "wall_s": median(walls),
            "greedy": lambda ids, n: run(ids, n)[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=f"bench/results/engine-cpu-{datetime.date.today()}.json")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--serve-concurrency", type=int, default=32,
                        help="clients in flight against the plain OpenAI server (0: skip)")
    parser.add_argument("--port", type=int, default=8124)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    settings = {"max_num_seqs": max(batches), "max_num_batched_tokens": 4096}
    start = time.perf_counter()
    llm = LLM("smollm2", **settings)
    greedy_ids(llm, llm.get_tokenizer().encode(PROMPT), 1)
    startup_q = time.perf_counter() - start
    start = time.perf_counter()
    exact = LLM("smollm2", dtype="float32", **settings)
    greedy_ids(exact, exact.get_tokenizer().encode(PROMPT), 1)
    startup_f32 = time.perf_counter() - start
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer.encode(f"0. {PROMPT}")
    bandwidth = copy_bandwidth_gb_s()
    bytes_q, bytes_f32 = weight_bytes_per_token(llm), weight_bytes_per_token(exact)
    results: dict[str, object] = {
        "benchmark": "engine-offline", "model": "SmolLM2-135M-Instruct (GGUF: Q4_1 projections, Q8_0 embedding)",
        "paths": {"ours": ("default on a CPU: Q4_1 projections and the tied Q8_0 logits kept 4- and 8-bit, repacked "
                           "for the native AVX-512 VNNI kernel (kernels/cpu_native.c), which takes every row count; "
                           "float32 elsewhere"
                           if cpu_native.vnni_available() else
                           "default on a CPU: Q4_1 projections and the tied Q8_0 logits kept in the file's blocks, "
                           "the native AVX2 kernels (kernels/cpu_native.c) for fewer than 32 rows, a float32 GEMM "
                           "over their exact dequantization from 32 on (the VNNI kernel does not run here: "
                           f"{cpu_native.vnni_status()[1]}); float32 elsewhere"
                           if cpu_native.available() else
                           "default on a CPU: Q4_1 projections kept 4-bit (torch _weight_int4pack_mm_for_cpu), tied "
                           f"Q8_0 logits int8 per row (_weight_int8pack_mm), float32 elsewhere; the native kernels "
                           f"do not run here: {cpu_native.status()[1]}"),
                  "ours_float32": "dtype=float32: every weight dequantized (transformers' weights)"},
        "kernels": [r for r in llm.engine.model.kernel_choices()
                    if r["component"] in ("linear", "logits", "rms_norm", "qkv_prepare", "attention", "decode_step")],
        "new_tokens": args.new_tokens, "repeats": args.repeats, "environment": environment(),
        "startup_to_first_token_s": {"ours": startup_q, "ours_float32": startup_f32},
        "copy_bandwidth_gb_s": bandwidth,
        "weight_bytes_per_token": {"ours": bytes_q, "ours_float32": bytes_f32},
        "batch1_roofline_tok_s": {"ours": bandwidth * 1e9 / bytes_q, "ours_float32": bandwidth * 1e9 / bytes_f32},
        "rows": []}
    anchor = llama_cpp_anchor(args.new_tokens, args.repeats, prompt_ids)
    greedy_cpp = anchor.pop("greedy", None)
    results["llama_cpp"] = anchor
    agreement = []
    for name, ids in [("chat: " + c[0]["content"], tokenizer.encode_chat(c)) for c in CHATS] + [("prompt", prompt_ids)]:
        q, f = greedy_ids(llm, ids, 64), greedy_ids(exact, ids, 64)
        eos = set(tokenizer.eos_token_ids)
        entry: dict[str, object] = {"input": name, "tokens": 64,
                                    "float32_eos_at": next((i for i, t in enumerate(f) if t in eos), None),
                                    "ours_vs_float32_first_difference": first_difference(q, f)}
        if callable(greedy_cpp):
            c = greedy_cpp(ids, 64)
            entry["llama_cpp_vs_ours_first_difference"] = first_difference(c, q)
            entry["llama_cpp_vs_float32_first_difference"] = first_difference(c, f)
        agreement.append(entry)
        print(json.dumps(entry))
    results["greedy_agreement"] = agreement
    hf = tok = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        directory, name = os.path.split(resolve_model_path("smollm2"))
        hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    rows = []
    for batch in batches:
        row: dict[str, object] = {"batch": batch, "ours": bench_ours(llm, batch, args.new_tokens, args.repeats),
                                  "ours_float32": bench_ours(exact, batch, args.new_tokens, args.repeats)}
        if hf is not None:
            row["transformers"] = bench_hf(hf, tok, batch, args.new_tokens, args.repeats)
            row["throughput_ratio"] = row["ours_float32"]["throughput_tok_s"] / row["transformers"]["throughput_tok_s"]  # type: ignore[index]
        if "batch1_tok_s" in anchor:
            # llama.cpp serves one request at a time: its throughput for any batch is its batch-1 rate
            row["vs_llama_cpp_sequential"] = row["ours"]["throughput_tok_s"] / anchor["batch1_tok_s"]  # type: ignore[index, operator]
        rows.append(row)
        print(json.dumps(row))
    results["rows"] = rows
    if args.serve_concurrency:
        served = bench_serving(args.serve_concurrency, args.new_tokens, len(prompt_ids), args.port)
        if "batch1_tok_s" in anchor:
            served["vs_llama_cpp_sequential"] = served["output_tok_s"] / anchor["batch1_tok_s"]  # type: ignore[operator]
        results["serving"] = served
        print(json.dumps(served))
    lean = getattr(llm.engine.model, "cpu_decode", None)
    results["fast_paths"] = {  # which path the default's steps took (a silent fallback is not a result)
        "lean_cpu_decode_steps": lean.num_steps if lean is not None else 0,
        "eager_steps": llm.engine.runner.num_eager_steps}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"llama.cpp batch 1: {anchor.get('batch1_tok_s', float('nan')):.1f} tok/s; roofline (batch 1): "
          f"{results['batch1_roofline_tok_s']}")  # type: ignore[index]
    print(f"{'batch':>5} {'ours tok/s':>11} {'f32 tok/s':>10} {'hf tok/s':>9} {'f32/hf':>7} {'vs llama.cpp':>13} "
          f"{'ours ms/step':>13}")
    for row in rows:
        ours, f32, theirs = row["ours"], row["ours_float32"], row.get("transformers", {})
        print(f"{row['batch']:>5} {ours['throughput_tok_s']:>11.1f} {f32['throughput_tok_s']:>10.1f} "
              f"{theirs.get('throughput_tok_s', float('nan')):>9.1f} {row.get('throughput_ratio', float('nan')):>7.2f} "
              f"{row.get('vs_llama_cpp_sequential', float('nan')):>13.2f} {ours['decode_step_ms']:>13.1f}")


if __name__ == "__main__":
    main()
