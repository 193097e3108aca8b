"""Where a pipelined verify step's time goes, per draft mode (coupled drafts against the head's
argmax), for sampled requests (seeded or not) on the embedded default model: per engine step, the
host time of the launch (``ModelRunner.launch_verify``), the time waiting for the step in flight
(its event), the host time taking its tokens, and the whole ``step()``, with the engine's step
counters (every prompt once, unprofiled); then every prompt again under torch.profiler: its
operators by host time and the GPU kernels by device time, per step.

    python bench/spec_step_profile.py --model <SmolLM2 .gguf> --temperature 1.0 --out ...   # on the GPU machine
    python bench/spec_step_profile.py --tiny      # a small random model and head: checks the script only
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, write_result  # noqa: E402
from bench.spec_decode import PROMPTS, tiny_model  # noqa: E402


def median_ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 4) if values else 0.0


def profile_mode(model: str, head: str, mode: str, temperature: float, seed: int | None, k: int,
                 max_tokens: int, top: int, sync_debug: bool = False) -> dict[str, Any]:
    import torch

    from cluster import LLM, SamplingParams
    llm = LLM(model, max_num_seqs=8, speculative_method="draft_head", num_speculative_tokens=k,
              speculative_model=head, speculative_draft_sampling=mode)
    engine = llm.engine
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)
    prompts = [p for ps in PROMPTS.values() for p in ps]
    llm.chat([{"role": "user", "content": prompts[0]}], params)  # warm up every path
    times: dict[str, list[float]] = {"launch": [], "wait": [], "take": [], "step": []}
    launch, complete, step = engine.runner.launch_verify, engine._complete_verify, engine.step

    def timed_launch(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = launch(*args, **kwargs)
        times["launch"].append(time.perf_counter() - t)
        return out

    def timed_complete(flight: Any) -> None:
        t = time.perf_counter()
        if flight.launch.done is not None:
            flight.launch.done.synchronize()
        t1 = time.perf_counter()
        complete(flight)
        times["wait"].append(t1 - t)
        times["take"].append(time.perf_counter() - t1)

    def timed_step() -> Any:
        t = time.perf_counter()
        out = step()
        times["step"].append(time.perf_counter() - t)
        return out
    engine.runner.launch_verify, engine._complete_verify, engine.step = timed_launch, timed_complete, timed_step
    runner, drafter = engine.runner, engine.runner.drafter

    def counters() -> dict[str, int]:
        return {"pipelined_verify_steps": engine.num_pipelined_verify_steps, "sync_steps": engine.num_sync_steps,
                "graph_steps": runner.num_graph_steps, "eager_steps": runner.num_eager_steps,
                "verify_graph_steps": runner.num_verify_graph_steps,
                "sampled_verify_graph_steps": runner.num_sampled_verify_graph_steps,
                "seeded_launches": runner.num_seeded_launches,
                "coupled_launches": runner.num_noise_launches, "head_graph_proposals": drafter.num_graph_proposals,
                "head_eager_proposals": drafter.num_eager_proposals}

    def run_all() -> tuple[int, float]:
        start = time.perf_counter()
        outs = [llm.chat([{"role": "user", "content": p}], params)[0] for p in prompts]
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start
    # unprofiled first: the timings that count
    syncs: dict[str, int] = {}
    if sync_debug:  # where the host waits for the GPU inside the loop: torch's synchronizing-op warnings
        import traceback
        import warnings

        def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            where = "".join(traceback.format_stack(limit=9)[:-2]) + f"{category.__name__}: {message}"
            syncs[where] = syncs.get(where, 0) + 1
        warnings.showwarning = record
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
    before = counters()
    tokens, wall = run_all()
    after = counters()
    if sync_debug:
        torch.cuda.set_sync_debug_mode(0)
    plain = {"steps": len(times["step"]), "tokens": tokens, "wall_s": round(wall, 3),
             "tokens_per_step": round(tokens / max(1, len(times["step"])), 3),
             "counters": {name: after[name] - before[name] for name in after},
             "median_ms": {name: median_ms(v) for name, v in times.items()},
             "mean_ms": {name: round(1000 * sum(v) / len(v), 4) if v else 0.0 for name, v in times.items()}}
    for v in times.values():
        v.clear()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        _, wall = run_all()
    steps = max(1, len(times["step"]))
    averages = prof.key_averages()
    by_host = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    device_attr = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    by_device = sorted(averages, key=lambda e: getattr(e, device_attr, 0), reverse=True)[:top]
    stats = engine.spec_stats
    return {
        "mode": mode, "unprofiled": plain,
        "synchronizing_calls": [{"count": c, "where": w} for w, c in sorted(syncs.items(), key=lambda x: -x[1])][:top],
        "acceptance": round(stats.num_accepted_tokens / stats.num_draft_tokens, 3) if stats.num_draft_tokens else 0.0,
        "profiled": {"steps": len(times["step"]), "wall_s": round(wall, 3),
                     "median_ms": {name: median_ms(v) for name, v in times.items()}},
        "host_ops_per_step": [{"op": e.key, "calls": round(e.count / steps, 2),
                               "self_host_us": round(e.self_cpu_time_total / steps, 1)} for e in by_host],
        "device_kernels_per_step": [{"kernel": e.key[:120], "calls": round(e.count / steps, 2),
                                     "self_device_us": round(getattr(e, device_attr, 0) / steps, 1)}
                                    for e in by_device if getattr(e, device_attr, 0) > 0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--speculative-model", default=None, help="draft head weights (default: the shipped one)")
    parser.add_argument("--tiny", action="store_true", help="a small random model and head (checks the script)")
    parser.add_argument("--modes", default="greedy,coupled")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1, help="-1: unseeded")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sync-debug", action="store_true",
                        help="record where the unprofiled pass synchronizes with the GPU (torch.cuda.set_sync_debug_mode)")
    parser.add_argument("--out", default="bench/results/spec-step-profile.json")
    args = parser.parse_args()
    model, head = args.model, args.speculative_model
    max_tokens = args.max_tokens
    if args.tiny:
        model, head = tiny_model()
        max_tokens = 24
    seed = None if args.seed < 0 else args.seed
    rows = [profile_mode(model, head, m, args.temperature, seed, args.k, max_tokens, args.top, args.sync_debug)
            for m in args.modes.split(",")]
    for r in rows:
        u = r["unprofiled"]
        print(r["mode"], u["steps"], "steps", u["tokens_per_step"], "tokens/step", u["wall_s"], "s; median ms",
              u["median_ms"], "mean ms", u["mean_ms"], u["counters"])
        for sync in r["synchronizing_calls"][:6]:
            print("   sync x", sync["count"], "\n" + sync["where"])
        for op in r["host_ops_per_step"][:12]:
            print("   host", op)
        for kern in r["device_kernels_per_step"][:8]:
            print("   device", kern)
    write_result(args.out, {"bench": "spec-step-profile", "environment": environment(), "model": model,
                            "sampling": f"temperature {args.temperature}, seed {seed}", "k": args.k,
                            "max_tokens": max_tokens, "modes": rows})


if __name__ == "__main__":
    main()
