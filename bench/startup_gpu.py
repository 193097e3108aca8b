"""Where engine start-up time goes on a GPU, for DeepSeek-V4: the tiny random V4 config of the tests
(sliding, CSA and HCA layers; the LLM that took about 4 minutes to become ready) and the
V4-Flash-width bench model of ``bench/v4_decode_gpu.py`` (4 layers, MXFP4 experts, dummy weights).

Each case builds an ``LLMEngine`` as a user would (graphs on) and reports, from a fresh process's
point of view (Triton's on-disk cache emptied first, unless ``--warm-cache``):
  total_s          constructor wall time (load, KV allocation, graph warm-up, capture, self-check)
  phases           ``LLMEngine.startup_timings``: load, per graph size warm-up, capture, verify
  triton_compile   kernels compiled (count, seconds between Triton's pre- and post-compile hooks)
  triton_autotune  per kernel: keys tuned, configs benchmarked, seconds inside the autotuner
                   (compiles of the configs it tries included)
Then a second engine of the same model in the same process (what a test making two LLMs pays).

    python bench/startup_gpu.py --out bench/results/startup-h200-<date>.json
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, write_result  # noqa: E402


class TritonLog:
    """Counts Triton compiles and autotuning through Triton's hooks and the autotuner's bench."""

    def __init__(self) -> None:
        from triton import knobs
        from triton.runtime import autotuner
        self.compiles = 0
        self.compile_s = 0.0
        self.by_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        self.tuning: dict[str, dict[str, float]] = defaultdict(lambda: {"keys": 0, "configs": 0, "seconds": 0.0})
        self._started: float | None = None
        knobs.runtime.jit_cache_hook = self._before_compile
        knobs.runtime.jit_post_compile_hook = self._after_compile
        original_bench, original_run = autotuner.Autotuner._bench, autotuner.Autotuner.run
        log = self

        def bench(tuner: Any, *args: Any, **kwargs: Any) -> Any:
            log.tuning[tuner.base_fn.__name__]["configs"] += 1
            return original_bench(tuner, *args, **kwargs)

        def run(tuner: Any, *args: Any, **kwargs: Any) -> Any:
            before = len(tuner.cache)
            start = time.perf_counter()
            try:
                return original_run(tuner, *args, **kwargs)
            finally:
                if len(tuner.cache) > before:
                    entry = log.tuning[tuner.base_fn.__name__]
                    entry["keys"] += len(tuner.cache) - before
                    entry["seconds"] += time.perf_counter() - start
        autotuner.Autotuner._bench, autotuner.Autotuner.run = bench, run

    def _before_compile(self, **_: Any) -> None:
        self._started = time.perf_counter()
        return None  # a true value would skip the compile

    def _after_compile(self, fn: Any = None, **_: Any) -> None:
        self.compiles += 1
        if self._started is not None:
            seconds = time.perf_counter() - self._started
            self.compile_s += seconds
            entry = self.by_kernel[getattr(fn, "name", "?")]
            entry[0] += 1
            entry[1] += seconds
            self._started = None

    def snapshot(self) -> dict[str, Any]:
        tuning = {k: dict(v) for k, v in sorted(self.tuning.items(), key=lambda kv: -kv[1]["seconds"])}
        kernels = {k: {"compiles": int(n), "seconds": round(s, 2)}
                   for k, (n, s) in sorted(self.by_kernel.items(), key=lambda kv: -kv[1][1])}
        return {"compiles": self.compiles, "compile_s": round(self.compile_s, 2),
                "autotune_s": round(sum(v["seconds"] for v in tuning.values()), 2), "autotune": tuning,
                "compiles_by_kernel": kernels}

    def reset(self) -> None:
        self.compiles, self.compile_s = 0, 0.0
        self.tuning.clear()
        self.by_kernel.clear()


def timed_engine(make: Any, log: TritonLog) -> dict[str, Any]:
    import torch
    gc.collect()  # the previous engine's KV cache back to the GPU (each sizes its cache from free memory)
    torch.cuda.empty_cache()
    log.reset()
    start = time.perf_counter()
    engine = make()
    total = time.perf_counter() - start
    return {"total_s": round(total, 2), "phases": {k: round(v, 2) for k, v in engine.startup_timings.items()},
            "cuda_graphs": engine.runner.graph_status.describe(), **log.snapshot()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"bench/results/startup-h200-{datetime.date.today()}.json")
    parser.add_argument("--warm-cache", action="store_true", help="keep Triton's on-disk cache")
    parser.add_argument("--cases", default="v4-tiny,v4-flash-width")
    args = parser.parse_args(argv)
    cache = os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(tempfile.gettempdir(), "pd-startup-triton"))
    if not args.warm_cache:
        shutil.rmtree(cache, ignore_errors=True)
    log = TritonLog()
    from bench.serve_gpu import WIDTH, write_model_dir
    from bench.v4_decode_gpu import make_engine as v4_bench_engine
    from bench.deepseek_v4_layers import model_config
    from cluster.config import CacheConfig, ModelConfig, SchedulerConfig
    from cluster.engine.engine import LLMEngine
    from tests.deepseek_factories import make_v4_checkpoint

    result: dict[str, Any] = {"benchmark": "engine-startup", "environment": environment(),
                              "triton_cache": "warm" if args.warm_cache else "empty at start", "cases": {}}
    with tempfile.TemporaryDirectory() as workdir:
        tiny, wide = os.path.join(workdir, "v4-tiny"), os.path.join(workdir, "v4-flash-width")
        make_v4_checkpoint(tiny, "csa_hca")
        write_model_dir(wide, dict(model_config(False), vocab_size=WIDTH["vocab_size"], torch_dtype="bfloat16"))
        makers = {
            # the tests' tiny model as an LLM(path) user gets it: default scheduler (64 sequences)
            "v4-tiny": lambda: LLMEngine(ModelConfig(model=tiny, dtype="bfloat16"), CacheConfig(block_size=16),
                                         SchedulerConfig()),
            "v4-flash-width": lambda: v4_bench_engine(wide, "cuda", False, 32),
        }
        for name in args.cases.split(","):
            case: dict[str, Any] = {}
            try:
                case["first"] = timed_engine(makers[name], log)
                print(name, "first", case["first"])
                case["second"] = timed_engine(makers[name], log)
                print(name, "second", case["second"])
            except Exception as exc:  # noqa: BLE001 - record and go on
                case["error"] = repr(exc)
            result["cases"][name] = case
            write_result(args.out, result)  # after each case: a run cut short keeps what it measured
    for name, case in result["cases"].items():
        for which in ("first", "second"):
            c = case.get(which)
            if c:
                print(f"{name:16s} {which:6s} total {c['total_s']:7.1f} s  compiles {c['compiles']:4d} "
                      f"({c['compile_s']:.1f} s)  autotune {c['autotune_s']:.1f} s  {c['cuda_graphs']}")
    return result


if __name__ == "__main__":
    main()
