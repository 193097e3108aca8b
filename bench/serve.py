"""Serving benchmark: a load generator for any OpenAI-compatible endpoint (this project's server,
vLLM, SGLang...).

    python bench/serve.py --base-url http://127.0.0.1:8000 --model smollm2 --num-requests 64 \
        --rate 2 --input-len 128 --output-len 64 --ttft-target-s 1 --itl-target-s 0.1 \
        --out bench/results/serve-cpu.json --plot bench/results/serve-cpu.png --label disagg

Each request is a streaming ``/v1/completions`` call with ``max_tokens`` (and ``ignore_eos``, an
extension vLLM and SGLang accept too) so that outputs have the requested length. Prompts are
random token ids (exact lengths; ``--token-id-range`` keeps them inside any vocabulary) or, with
``--prompt-kind text``, common words (about one token each; the usage tells the real count).
Lengths vary uniformly in ``L * [1 - r, 1 + r]`` with ``--input-len-range r`` and
``--output-len-range r``. Arrivals are Poisson at ``--rate`` requests/s, or all at once; either
way at most ``--concurrency`` run at a time when it is given.

Measured per request: TTFT (send to the first chunk carrying text), ITL (every gap between two
such chunks), end-to-end latency, TPOT ((e2e - TTFT) / (output tokens - 1)) and token counts.
Reported: mean/p50/p90/p99/max of each, request and token throughput, and goodput: requests per
second that met both targets, TTFT <= ``--ttft-target-s`` and TPOT <= ``--itl-target-s`` (the
per-request mean inter-token latency, as vLLM's goodput counts it). With ``--server-timings``
(this project's servers) each request also keeps the server's own account of its time
(``return_timings``: preparation, TTFT and e2e at the front end, the workers' queue, prefill,
KV transfer and first decode step), and each part is summarized like the client's figures, with
``outside_ttft_s``: the client's TTFT less the front end's (HTTP, the proxy, the stream back).
Other scripts call
``run_benchmark(BenchConfig(...))``, which returns the result dict that ``--out`` writes.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    import httpx
except ImportError:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx  # type: ignore[no-redef]

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one "
         "had by word but not what all were we when your can said there use an each which she do how their "
         "if will up other about out many then them these so some her would make like him into time has "
         "look two more write go see number no way could people my than first water been call who oil its "
         "now find long down day did get come made may part").split()


@dataclass
class BenchConfig:
    base_url: str
    model: str
    num_requests: int = 32
    #: Poisson arrivals at this many requests/s; None sends them all at once.
    rate: float | None = None
    concurrency: int | None = None
    input_len: int = 128
    output_len: int = 64
    #: Relative spread of the lengths: uniform in L * [1 - r, 1 + r].
    input_len_range: float = 0.0
    output_len_range: float = 0.0
    ttft_target_s: float = 1.0
    itl_target_s: float = 0.1
    seed: int = 0
    label: str = ""
    prompt_kind: str = "ids"
    token_id_range: tuple[int, int] = (100, 1000)
    temperature: float = 0.0
    ignore_eos: bool = True
    warmup: int = 1
    api_key: str | None = None
    timeout_s: float = 600.0
    command: str = ""
    #: Ask for each choice's ``timings`` (``return_timings``, this project's extension: where the
    #: request's time went on the server) and keep them per request; other servers ignore it.
    server_timings: bool = False


@dataclass
class RequestRecord:
    start_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    #: The server's own account of the request (``BenchConfig.server_timings``), seconds by part.
    server_timings: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - (self.ttft_s or 0.0)) / (self.output_tokens - 1)


def _lengths(rng: random.Random, mean: int, spread: float, n: int) -> list[int]:
    lo, hi = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return [rng.randint(lo, hi) for _ in range(n)]


def request_lengths(config: BenchConfig, rng: random.Random | None = None) -> tuple[list[int], list[int]]:
    """Prompt and output lengths of every request, warm-up ones first (the first draws of the
    ``config.seed`` stream, so a run's workload can be replayed from its recorded config)."""
    rng = rng or random.Random(config.seed)
    n = config.num_requests + config.warmup
    return (_lengths(rng, config.input_len, config.input_len_range, n),
            _lengths(rng, config.output_len, config.output_len_range, n))


def arrival_times(config: BenchConfig) -> list[float]:
    """When each timed request is sent, seconds after the timed phase starts (Poisson at
    ``config.rate`` from the ``config.seed + 1`` stream; all at 0 without a rate)."""
    rng = random.Random(config.seed + 1)
    at, times = 0.0, []
    for _ in range(config.num_requests):
        times.append(at)
        if config.rate:
            at += rng.expovariate(config.rate)
    return times


def build_prompts(config: BenchConfig) -> list[tuple[str | list[int], int, int]]:
    """(prompt, prompt length asked for, output length) for every request, seeded."""
    rng = random.Random(config.seed)
    inputs, outputs = request_lengths(config, rng)
    lo, hi = config.token_id_range
    prompts: list[tuple[str | list[int], int, int]] = []
    for length, out_len in zip(inputs, outputs):
        if config.prompt_kind == "ids":
            prompt: str | list[int] = [rng.randrange(lo, hi) for _ in range(length)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(length))
        prompts.append((prompt, length, out_len))
    return prompts


async def _send(http: httpx.AsyncClient, config: BenchConfig, prompt: str | list[int], prompt_len: int,
                output_len: int, t0: float) -> RequestRecord:
    body: dict[str, Any] = {"model": config.model, "prompt": prompt, "max_tokens": output_len,
                            "temperature": config.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.server_timings:
        body["return_timings"] = True
    record = RequestRecord(prompt_tokens=prompt_len)
    start = time.perf_counter()
    record.start_s = start - t0
    last, chunks = None, 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                data = json.loads(line[6:])
                if "error" in data:
                    record.error = f"stream error: {data['error'].get('message')}"
                    break
                if data.get("usage"):
                    record.prompt_tokens = data["usage"].get("prompt_tokens", prompt_len)
                    record.output_tokens = data["usage"].get("completion_tokens", chunks)
                for c in data.get("choices") or []:
                    if c.get("timings"):
                        record.server_timings = c["timings"]
                if any(c.get("text") for c in data.get("choices") or []):
                    chunks += 1
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
    except (httpx.HTTPError, OSError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.e2e_s = time.perf_counter() - start
    record.output_tokens = record.output_tokens or chunks
    if record.error is None and record.ttft_s is None:
        record.error = "no text received"
    return record


async def _run(config: BenchConfig) -> tuple[list[RequestRecord], float]:
    prompts = build_prompts(config)
    warmup, timed = prompts[:config.warmup], prompts[config.warmup:]
    gate = asyncio.Semaphore(config.concurrency or len(timed) or 1)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency or max(1, len(timed)), max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=config.base_url, timeout=config.timeout_s, headers=headers,
                                 limits=limits) as http:
        for prompt, prompt_len, out_len in warmup:
            await _send(http, config, prompt, prompt_len, out_len, time.perf_counter())
        t0 = time.perf_counter()

        async def one(prompt: str | list[int], prompt_len: int, out_len: int, at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            async with gate:
                return await _send(http, config, prompt, prompt_len, out_len, t0)

        tasks = [asyncio.create_task(one(prompt, prompt_len, out_len, at))
                 for (prompt, prompt_len, out_len), at in zip(timed, arrival_times(config))]
        records = list(await asyncio.gather(*tasks))
        return records, time.perf_counter() - t0


def latency_stats(values: list[float]) -> dict[str, float | None]:
    """Mean, p50 / p90 / p99 (numpy's linear interpolation) and max of a list of seconds."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99)), "max": float(arr.max())}


def summarize(config: BenchConfig, records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    good = [r for r in ok if (r.ttft_s or 0.0) <= config.ttft_target_s
            and (r.tpot_s is None or r.tpot_s <= config.itl_target_s)]
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    timed = [(r, r.server_timings) for r in ok if r.server_timings]
    server: dict[str, Any] = {}
    if timed:
        for part in sorted({k for _, t in timed for k in t}):
            server[part] = latency_stats([t[part] for _, t in timed if part in t])
        server["outside_ttft_s"] = latency_stats([(r.ttft_s or 0.0) - t["ttft"] for r, t in timed if "ttft" in t])
    return {
        "label": config.label, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": config.command, "endpoint": config.base_url, "model": config.model,
        "config": {k: v for k, v in dataclasses.asdict(config).items() if k not in ("api_key", "command")},
        "versions": {"python": platform.python_version(), "httpx": getattr(httpx, "__version__", "?")},
        "client_host": {"platform": platform.platform(), "cpus": os.cpu_count()}, "commit": _git_commit(),
        "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok), "errors": errors,
        "duration_s": duration_s, "total_prompt_tokens": prompt_tokens, "total_output_tokens": output_tokens,
        "request_throughput_rps": len(ok) / duration, "output_token_throughput_tps": output_tokens / duration,
        "total_token_throughput_tps": (prompt_tokens + output_tokens) / duration,
        "goodput_rps": len(good) / duration, "goodput_fraction": len(good) / max(1, len(records)),
        "goodput_definition": f"TTFT <= {config.ttft_target_s} s and TPOT <= {config.itl_target_s} s",
        "ttft_s": latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": latency_stats([gap for r in ok for gap in r.itl_s]),
        "tpot_s": latency_stats([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_s": latency_stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        **({"server_timings_s": server} if server else {}),
        "requests": [{"start_s": round(r.start_s, 6), "ttft_s": r.ttft_s, "e2e_s": r.e2e_s, "tpot_s": r.tpot_s,
                      "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "error": r.error,
                      "itl_s": [round(g, 6) for g in r.itl_s],
                      **({"server_timings": r.server_timings} if r.server_timings else {})} for r in records],
    }


def _git_commit() -> str | None:
    """The commit benchmarked: PD_BENCH_COMMIT where a copied tree's git is stale (the GPU machine)."""
    if os.environ.get("PD_BENCH_COMMIT"):
        return os.environ["PD_BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Run the benchmark (from synchronous code) and return its result dict."""
    records, duration = asyncio.run(_run(config))
    return summarize(config, records, duration)


def plot_results(results: list[dict[str, Any]], path: str) -> None:
    """Latency CDFs (TTFT, ITL, e2e) and p50/p90/p99 bars of one or several runs, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [("ttft_s", "TTFT (s)"), ("itl_s", "Inter-token latency (s)"), ("e2e_s", "End-to-end latency (s)")]
    for ax, (key, title) in zip(axes.flat, panels):
        for i, result in enumerate(results):
            ok = [r for r in result["requests"] if r["error"] is None]
            values = sorted(g for r in ok for g in r["itl_s"]) if key == "itl_s" else sorted(
                r[key] for r in ok if r[key] is not None)
            if values:
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=_name(result, i))
        ax.set_title(f"CDF: {title}")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    width = 0.8 / max(1, len(results))
    groups = [f"{key.removesuffix('_s')} {q}" for key, _ in panels for q in ("p50", "p90", "p99")]
    for i, result in enumerate(results):
        heights = [result[key][q] or 0.0 for key, _ in panels for q in ("p50", "p90", "p99")]
        ax.bar(np.arange(len(groups)) + i * width, heights, width, label=_name(result, i))
    ax.set_xticks(np.arange(len(groups)) + width * (len(results) - 1) / 2, groups, rotation=45, ha="right",
                  fontsize=8)
    ax.set_yscale("log")
    ax.set_title("Latency percentiles (s, log scale)")
    ax.legend(fontsize=8)
    first = results[0]
    fig.suptitle(f"{first['model']} @ {first['endpoint']}: " + ", ".join(
        f"{_name(r, i)}: {r['request_throughput_rps']:.2f} req/s, goodput {r['goodput_rps']:.2f}/s"
        for i, r in enumerate(results)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _name(result: dict[str, Any], index: int) -> str:
    return result.get("label") or f"run {index}"


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model name (default: the endpoint's first /v1/models entry)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--rate", type=float, help="Poisson arrival rate (requests/s); default: all at once")
    p.add_argument("--concurrency", type=int, help="most requests in flight")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--input-len-range", type=float, default=0.0, help="relative spread r: L * [1-r, 1+r]")
    p.add_argument("--output-len-range", type=float, default=0.0)
    p.add_argument("--ttft-target-s", type=float, default=1.0)
    p.add_argument("--itl-target-s", type=float, default=0.1)
    p.add_argument("--prompt-kind", choices=("ids", "text"), default="ids")
    p.add_argument("--token-id-range", type=int, nargs=2, default=(100, 1000), metavar=("LO", "HI"))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (plain OpenAI)")
    p.add_argument("--server-timings", action="store_true",
                   help="ask for each request's server-side timings (return_timings: this project's extension) "
                        "and keep them per request")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests first")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="")
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--plot", help="write a PNG plot here")
    args = p.parse_args(argv)
    if args.num_requests < 1 or (args.concurrency is not None and args.concurrency < 1):
        p.error("--num-requests and --concurrency must be >= 1")
    if args.rate is not None and args.rate <= 0:
        p.error("--rate must be > 0")
    return args


def _first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse_args(argv)
    config = BenchConfig(
        base_url=args.base_url.rstrip("/"), model=args.model or _first_model(args.base_url, args.api_key),
        num_requests=args.num_requests, rate=args.rate, concurrency=args.concurrency, input_len=args.input_len,
        output_len=args.output_len, input_len_range=args.input_len_range, output_len_range=args.output_len_range,
        ttft_target_s=args.ttft_target_s, itl_target_s=args.itl_target_s, seed=args.seed, label=args.label,
        prompt_kind=args.prompt_kind, token_id_range=tuple(args.token_id_range), temperature=args.temperature,
        ignore_eos=not args.no_ignore_eos, warmup=args.warmup, api_key=args.api_key, timeout_s=args.timeout_s,
        server_timings=args.server_timings, command=shlex.join(["python", "bench/serve.py", *argv]))
    result = run_benchmark(config)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot_results([result], args.plot)
    summary = {k: result[k] for k in ("completed", "failed", "request_throughput_rps",
                                      "output_token_throughput_tps", "goodput_rps")}
    summary.update({f"{k}_p50/p99": (result[k]["p50"], result[k]["p99"]) for k in ("ttft_s", "itl_s", "e2e_s")})
    print(json.dumps(summary, indent=1))
    return result


if __name__ == "__main__":
    main()
