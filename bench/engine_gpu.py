"""Engine decode speed on a GPU, for a Qwen3-8B-shaped model with random bf16 weights, against the
HBM roofline and HuggingFace transformers measured in the same run.

Rows (issue 5):
  decode-b1     one 512-token prompt, decode step time; roofline = weight bytes / copy bandwidth
  decode-b32    32 prompts of 512 tokens; roofline = (weights + KV read per step) / copy bandwidth
  *-sync        the same with async_scheduling off (each step waits for its tokens before the next)
  throughput    256 requests in flight, 512 in / 128 out: generated tokens / wall time
  transformers  ``generate`` with a static cache (it compiles itself) at batch 1 and 32 (and its
                best batch for throughput)
The copy bandwidth is measured here (device-to-device copy, bytes read + written). Decode step
times are medians over steps where every request is decoding (prefill excluded).

    python bench/engine_gpu.py --out bench/results/engine-h200-<date>.json [--skip-hf] [--tiny]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, median, require_graphs  # noqa: E402
from cluster.common.sampling_params import SamplingParams  # noqa: E402
from cluster.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from cluster.engine.engine import LLMEngine  # noqa: E402
from cluster.models.registry import BUILDERS, LoadedModel  # noqa: E402
from cluster.models.ops import resolve_ops  # noqa: E402

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 40960, "tie_word_embeddings": False}
TINY = {**QWEN3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024}


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes read + written per second by a device-to-device copy (median of 20)."""
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * src.numel() * src.element_size() / median(times[5:])


def random_model(config: dict[str, Any], device: torch.device, backend: str) -> LoadedModel:
    family = BUILDERS[config["architectures"][0]]
    ops = resolve_ops(family.components(config), device, attention_backend=backend)
    with torch.device(device):
        model = family.build(config, torch.bfloat16, ops)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)
    return LoadedModel(model.eval(), None, config, "random")


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def make_engine(loaded: LoadedModel, device: torch.device, max_num_seqs: int, eager: bool) -> LLMEngine:
    return LLMEngine(ModelConfig(model="random", device=str(device), dtype="bfloat16", enforce_eager=eager,
                                 max_model_len=4096),
                     CacheConfig(block_size=16, gpu_memory_utilization=0.85),
                     SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=16384), loaded=loaded)


def add_random_requests(engine: LLMEngine, count: int, prompt_len: int, new_tokens: int, tag: str, seed: int) -> None:
    """``count`` greedy requests of random prompts, each generating exactly ``new_tokens``."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(count):
        ids = torch.randint(100, engine.vocab_size - 100, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"{tag}-{i}", ids, params)


def decode_steps(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, tag: str) -> dict[str, float]:
    """Decode step time: the median interval between consecutive ``step()`` returns while every
    request decodes (prefill steps and the last steps excluded). No synchronisation is added
    between steps, so a pipelined engine (``async_scheduling``) overlaps as it does in serving;
    each ``step()`` still waits for the tokens it returns, so an interval is one step's work."""
    add_random_requests(engine, batch, prompt_len, new_tokens, tag, seed=batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall0 = time.perf_counter()
    returns, decoding = [], []
    while engine.has_work():
        engine.step()
        returns.append(time.perf_counter())
        decoding.append(bool(engine.groups) and all(g.samples[0].num_output_tokens > 0
                                                    for g in engine.groups.values()))
    wall = time.perf_counter() - wall0
    steps = [b - a for a, b, ok in zip(returns, returns[1:], decoding) if ok]
    step = median(steps[2:-2] or steps)
    return {"step_ms": 1000 * step, "tok_s": batch / step, "wall_s": wall, "steps_timed": len(steps),
            "pipelined_steps": engine.num_pipelined_steps}


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2


def decode_row(engine: LLMEngine, config: dict[str, Any], name: str, batch: int, prompt_len: int, new_tokens: int,
               weights: int, bandwidth: float) -> dict[str, float]:
    """``decode_steps`` plus the roofline: weight bytes and the KV read at the mean context, over
    the copy bandwidth."""
    r = decode_steps(engine, batch, prompt_len, new_tokens, name)
    ctx = prompt_len + new_tokens // 2
    roof_s = (weights + batch * ctx * kv_bytes_per_token(config)) / bandwidth
    r.update(roofline_tok_s=batch / roof_s, pct_of_roofline=100 * roof_s / (r["step_ms"] / 1000))
    return r


def throughput(engine: LLMEngine, requests: int, prompt_len: int, new_tokens: int) -> dict[str, float]:
    add_random_requests(engine, requests, prompt_len, new_tokens, "tp", seed=7)
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tok_s": requests * new_tokens / wall,
            "total_tok_s": requests * (prompt_len + new_tokens) / wall}


def hf_generate(config: dict[str, Any], device: torch.device, batch: int, prompt_len: int,
                new_tokens: int) -> dict[str, float]:
    import transformers
    cfg = transformers.Qwen3Config(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(100, cfg.vocab_size - 100, (batch, prompt_len), device=device)

    def run(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 cache_implementation="static", pad_token_id=0)
        torch.cuda.synchronize()
        assert out.shape[1] == prompt_len + n
        return time.perf_counter() - start
    run(new_tokens)  # compiles
    run(new_tokens)
    full = median([run(new_tokens) for _ in range(3)])
    first = median([run(1) for _ in range(3)])
    step = (full - first) / (new_tokens - 1)
    del model
    torch.cuda.empty_cache()
    return {"step_ms": 1000 * step, "tok_s": batch / step, "generate_s": full,
            "output_tok_s_incl_prefill": batch * new_tokens / full}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"bench/results/engine-h200-{datetime.date.today()}.json")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (smoke test)")
    parser.add_argument("--attention-backend", default="auto")
    args = parser.parse_args()
    device = torch.device("cuda")
    config = TINY if args.tiny else QWEN3_8B
    result: dict[str, Any] = {"benchmark": "engine-decode", "model": "Qwen3-8B-shaped, random bf16 weights",
                              "config": config, "environment": environment(), "rows": {}, "errors": {}}
    bw = copy_bandwidth(device, 0.25 if args.tiny else 2.0)
    result["copy_bandwidth_GBps"] = bw / 1e9
    loaded = random_model(config, device, args.attention_backend)
    wbytes = weight_bytes(loaded.model)
    result["weight_bytes"] = wbytes
    rows = result["rows"]
    sections = [("decode-b1", 1, 512, 64), ("decode-b32", 32, 512, 64),
                ("decode-b1-sync", 1, 512, 64), ("decode-b32-sync", 32, 512, 64)]
    try:
        engine = make_engine(loaded, device, 256, eager=False)
        result["kernels"] = engine.backends()
        result["cuda_graphs"] = require_graphs(engine, "engine decode")
        result["startup_s"] = engine.startup_timings
        for name, batch, plen, new in sections:
            # "-sync": async_scheduling off (each step reads its own tokens before the next is launched)
            engine._pipelined = not name.endswith("-sync")
            engine.num_pipelined_steps = 0
            try:
                r = decode_row(engine, config, name, batch, plen, new, wbytes, bw)
                rows[name] = r
                print(name, json.dumps(r))
            except Exception as exc:  # noqa: BLE001 - record and go on
                result["errors"][name] = repr(exc)
        engine._pipelined = True
        try:
            rows["throughput-256x512+128"] = throughput(engine, 256, 512, 128)
            print("throughput", json.dumps(rows["throughput-256x512+128"]))
        except Exception as exc:  # noqa: BLE001
            result["errors"]["throughput"] = repr(exc)
        del engine
    except Exception as exc:  # noqa: BLE001 - GraphsOffError (a SystemExit) passes through
        result["errors"]["engine"] = repr(exc)
    del loaded
    torch.cuda.empty_cache()
    if not args.skip_hf:
        for batch in (1, 32):
            try:
                rows[f"transformers-static-b{batch}"] = hf_generate(config, device, batch, 512, 64)
                print(f"transformers b{batch}", json.dumps(rows[f"transformers-static-b{batch}"]))
            except Exception as exc:  # noqa: BLE001
                result["errors"][f"transformers-b{batch}"] = repr(exc)
    for batch in (1, 32):
        ours, hf = rows.get(f"decode-b{batch}"), rows.get(f"transformers-static-b{batch}")
        if ours and hf:
            ours["vs_transformers"] = ours["tok_s"] / hf["tok_s"]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s, weights {wbytes / 1e9:.2f} GB")
    for name, r in rows.items():
        print(f"{name:28s} " + " ".join(f"{k}={v:.3g}" for k, v in r.items() if isinstance(v, float)))
    if result["errors"]:
        print("errors:", json.dumps(result["errors"], indent=1))


if __name__ == "__main__":
    main()
