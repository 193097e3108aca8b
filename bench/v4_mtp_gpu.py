"""DeepSeek-V4 MTP on a GPU: what speculation costs and gives the machine, at V4-Flash width.

Model: bench/deepseek_v4_layers.py's four layers (sliding, CSA, HCA, CSA) at V4-Flash width plus
the MTP layer, MXFP4 routed experts (the MTP layer's too), random weights (``load_format=dummy``).
Random weights accept no draft, so the acceptance is set by the benchmark: in the ``mtp`` rows
each draft is taken with probability ``a`` if every draft before it was (seeded), in place of the
comparison with the target's token (on the host in synchronous verify steps; pipelined ones decide
on the device, where ``DeviceSetAcceptance`` sets it inside the verify-step graph). The engine then
does all it does for that many accepted tokens
(per-token output path, KV truncation, the compressors' states rolled back to the accepted
position, the MTP layer's next pass from there); the run's tokens are not the model's, and that
is all that differs. For each batch (1, 8, 32): that many 512-token prompts, 48 new tokens; the
step time is the median interval between ``step()`` returns while every request decodes.
Rows:
  none-bB          no speculation: decode graphs, pipelined (the anchor, same run)
  verify-kK-bB     every request verifies k drafts (the last token repeated; the n-gram path, no
                   draft model): a verify step's cost alone
  mtp-kK-aA-bB     the MTP layer drafts k tokens per step (its proposal replays its draft graphs),
                   acceptance a in (0, 0.5, 0.8, 1): step time, tokens per step, output tok/s and
                   speedup over none; draft_ms = the mtp step at a = 0 less the verify step
                   (where the mtp rows' verify steps are pipelined and the verify rows' are
                   not, draft_ms also holds what pipelining saves); pipelined_steps = how many
                   of the row's verify steps were pipelined
  mtp-sync-kK-aA-bB  (``--compare-sync``) the same with pipelined_verify_kv_groups off in the same
                   run: synchronous verify steps, the host deciding between steps;
                   pipelined_over_sync = the mtp row's output tok/s over this row's
The anchors' acceptance is marked: DeepSeek-V3's MTP takes 85-90% of second tokens; about 3.1
accepted tokens per step with 3 drafts are reported for V4 (a ~ 0.85 per draft).

    python bench/v4_mtp_gpu.py --out bench/results/v4-mtp-h200-<date>.json
    python bench/v4_mtp_gpu.py --tiny --device cpu --out /tmp/v4-mtp.json   # plumbing check
"""
from __future__ import annotations

import argparse
import gc
import datetime
import json
import os
import random
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, require_graphs, write_result  # noqa: E402
from bench.deepseek_v4_layers import model_config  # noqa: E402
from bench.engine_gpu import decode_steps  # noqa: E402
from bench.serve_gpu import WIDTH, write_model_dir  # noqa: E402
from bench.spec_decode_gpu import RepeatLast  # noqa: E402
from cluster.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from cluster.engine import step_loop  # noqa: E402
from cluster.engine.engine import LLMEngine  # noqa: E402

BATCHES, KS, ACCEPTANCE, PROMPT, NEW = (1, 8, 32), (1, 2, 3), (0.0, 0.5, 0.8, 1.0), 512, 48
TINY_RUN = ((1, 2), (1, 2), (0.0, 1.0), 24, 8)
#: pipelined_verify_kv_groups for the engines (``--sync-verify``: off, V4's verify steps synchronous).
PIPELINED = True
ANCHORS = {"deepseek_v3_mtp_second_token": [0.85, 0.90], "v4_accepted_tokens_per_step_k3": 3.1}


def make_engine(path: str, device: str, method: str, k: int, max_num_seqs: int, **settings: Any) -> LLMEngine:
    """``settings``: more ModelConfig fields (e.g. ``dspark_cuda_graphs``)."""
    settings.setdefault("pipelined_verify_kv_groups", PIPELINED)
    return LLMEngine(ModelConfig(model=path, load_format="dummy", device=device, dtype="bfloat16",
                                 max_model_len=2048, speculative_method=method, num_speculative_tokens=max(k, 1),
                                 **settings),
                     CacheConfig(block_size=16, gpu_memory_utilization=0.85),
                     SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192))


class SetAcceptance:
    """In place of ``accepted_length``: each draft taken with probability ``a`` while every
    draft before it was (seeded, so every run draws the same)."""

    def __init__(self, a: float, seed: int = 0) -> None:
        self.a, self.rng = a, random.Random(seed)

    def __call__(self, drafts: list[int], targets: list[int]) -> int:
        m = 0
        while m < len(drafts) and self.rng.random() < self.a:
            m += 1
        return m


class DeviceSetAcceptance:
    """``SetAcceptance`` for pipelined verify steps, whose acceptance the device decides
    (``Ops.spec_accept_draft_rows``, inside the verify-step graph): the accept kernel is wrapped
    before the engine captures its graphs, and compares the drafts with targets made to agree with
    the first ``m`` of them, ``m = counts[base % L]`` (at most ``k``) from a device table of counts
    drawn like ``SetAcceptance`` (``set``: refilled in place, so the captured graphs read the new
    draws). The host reads the target's own tokens; only the acceptance is set."""

    LENGTH = 4093  # prime: consecutive steps of a request read unrelated entries

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None
        self.saved: list[tuple[Any, str, Any]] = []

    def install(self, device: str) -> None:
        import kernels.spec_decode
        self.counts = torch.zeros(self.LENGTH, dtype=torch.int64, device=device)
        modules = [(kernels.spec_decode, "accept_and_draft_rows_ref")]
        try:
            import kernels.triton_spec_decode
            modules.append((kernels.triton_spec_decode, "accept_and_draft_rows_triton"))
        except ImportError:
            pass
        for module, name in modules:
            real = getattr(module, name)
            self.saved.append((module, name, real))
            setattr(module, name, self._wrap(real))

    def uninstall(self) -> None:
        for module, name, real in self.saved:
            setattr(module, name, real)
        self.saved = []

    def set(self, a: float, seed: int = 0) -> None:
        assert self.counts is not None
        rng = random.Random(seed)
        draws = []
        for _ in range(self.LENGTH):
            m = 0
            while m < 8 and rng.random() < a:
                m += 1
            draws.append(m)
        self.counts.copy_(torch.tensor(draws, dtype=torch.int64))

    def _wrap(self, real: Any) -> Any:
        def accept(inputs: torch.Tensor, targets: torch.Tensor, base: torch.Tensor, *rest: Any) -> Any:
            assert self.counts is not None
            k = inputs.shape[1] - 1
            m = self.counts.index_select(0, base % self.LENGTH).clamp(max=k)  # [n]
            drafts = inputs[:, 1:]
            miss = torch.where(drafts > 0, drafts - 1, drafts + 1)
            j = torch.arange(k, device=inputs.device)[None, :]
            forced = torch.where(j < m[:, None], drafts, miss)
            return real(inputs, torch.cat((forced, targets[:, k:]), dim=1), base, *rest)
        return accept


DEVICE_ACCEPTANCE = DeviceSetAcceptance()


def measure(engine: LLMEngine, batch: int, prompt: int, new: int, name: str) -> dict[str, Any]:
    stats = engine.spec_stats
    drafts0, accepted0 = (stats.num_drafts, stats.num_accepted_tokens) if stats else (0, 0)
    pipelined0 = getattr(engine, "num_pipelined_verify_steps", 0)
    row: dict[str, Any] = decode_steps(engine, batch, prompt, new, name)
    row["pipelined_steps"] = getattr(engine, "num_pipelined_verify_steps", 0) - pipelined0
    if stats is not None and stats.num_drafts > drafts0:
        row["tokens_per_step"] = 1 + (stats.num_accepted_tokens - accepted0) / (stats.num_drafts - drafts0)
    else:
        row["tokens_per_step"] = 1.0
    row["output_tok_s"] = batch * row["tokens_per_step"] / (row["step_ms"] / 1000)
    return row


def run_method(result: dict[str, Any], path: str, device: str, method: str, k: int, acceptance: tuple[float, ...],
               batches: tuple[int, ...], prompt: int, new: int, **settings: Any) -> LLMEngine | None:
    """One row group: an engine for ``method`` (``none``, ``verify``: a verify step of ``k`` drafts
    alone, or a drafter), its fast paths recorded, and a row per set acceptance (drafters only)
    and batch. Returns the engine (None where it could not be built: the error is recorded)."""
    on_gpu = device.startswith("cuda")
    speculating = method not in ("none", "verify")
    if method == "mtp-sync":
        settings = dict(settings, pipelined_verify_kv_groups=False)
    if speculating:
        DEVICE_ACCEPTANCE.install(device)  # before the engine captures its verify-step graphs
    try:
        engine = make_engine(path, device, {"verify": "ngram", "mtp-sync": "mtp"}.get(method, method), k,
                             max(batches), **settings)
    except Exception as exc:  # noqa: BLE001 - record and go on
        result["errors"][f"{method}-k{k}"] = repr(exc)
        DEVICE_ACCEPTANCE.uninstall()
        return None
    if method == "verify":
        engine.proposer = RepeatLast()  # type: ignore[assignment]
    paths: dict[str, Any] = {
        "cuda_graphs": require_graphs(engine, f"{method} rows") if on_gpu else engine.runner.graph_status.describe(),
        "backends": engine.backends()}
    if engine.proposer is not None:
        status = getattr(engine, "spec_pipeline_status", "")
        paths.update(verify_steps_pipelined=not status, spec_pipeline_status=status)
    if engine.runner.drafter is not None:
        paths["draft_graphs"] = engine.runner.drafter.graph_status.describe()
    result["fast_paths"][f"{method}-k{k}"] = paths
    real_acceptance = step_loop.accepted_length
    try:
        for a in (acceptance if speculating else (0.0,)):
            step_loop.accepted_length = SetAcceptance(a) if speculating else real_acceptance  # type: ignore
            if speculating and DEVICE_ACCEPTANCE.counts is not None:
                DEVICE_ACCEPTANCE.set(a)
            for batch in batches:
                name = f"{method}-b{batch}" if method == "none" else (
                    f"verify-k{k}-b{batch}" if method == "verify" else f"{method}-k{k}-a{a}-b{batch}")
                try:
                    result["rows"][name] = row = measure(engine, batch, prompt, new, name)
                    print(name, json.dumps({x: round(v, 3) if isinstance(v, float) else v for x, v in row.items()}),
                          flush=True)
                except Exception as exc:  # noqa: BLE001
                    result["errors"][name] = repr(exc)
    finally:
        step_loop.accepted_length = real_acceptance
        DEVICE_ACCEPTANCE.uninstall()
    return engine


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"bench/results/v4-mtp-h200-{datetime.date.today()}.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy widths (plumbing check)")
    parser.add_argument("--batches", help="comma-separated batch sizes (default 1,8,32)")
    parser.add_argument("--ks", help="comma-separated draft lengths (default 1,2,3)")
    parser.add_argument("--acceptance", help="comma-separated set acceptances (default 0,0.5,0.8,1)")
    parser.add_argument("--compare-sync", action="store_true",
                        help="also mtp-sync rows: the MTP engines with synchronous verify steps, same run")
    parser.add_argument("--sync-verify", action="store_true",
                        help="pipelined_verify_kv_groups off: V4's verify steps synchronous (the default before it)")
    args = parser.parse_args(argv)
    global PIPELINED
    PIPELINED = not args.sync_verify
    batches, ks, acceptance, prompt, new = TINY_RUN if args.tiny else (BATCHES, KS, ACCEPTANCE, PROMPT, NEW)
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
    if args.ks:
        ks = tuple(int(k) for k in args.ks.split(","))
    if args.acceptance:
        acceptance = tuple(float(a) for a in args.acceptance.split(","))
    on_gpu = args.device.startswith("cuda")
    config = dict(model_config(args.tiny), vocab_size=WIDTH["vocab_size"], torch_dtype="bfloat16",
                  num_nextn_predict_layers=1)
    result: dict[str, Any] = {
        "benchmark": "v4-mtp", "config": config, "environment": environment(), "anchors": ANCHORS,
        "model": f"DeepSeek-V4-Flash width, {config['num_hidden_layers']} layers + the MTP layer, MXFP4 experts, "
                 "random weights",
        "method": f"{prompt}-token prompts, {new} new tokens, median step; acceptance set by the benchmark "
                  "(see the script); none is the anchor", "pipelined_verify_kv_groups": PIPELINED,
        "rows": {}, "errors": {}, "fast_paths": {}}
    rows = result["rows"]
    with tempfile.TemporaryDirectory() as path:
        write_model_dir(path, config)
        methods = ("verify", "mtp", "mtp-sync") if args.compare_sync else ("verify", "mtp")
        for method, k in [("none", 0)] + [(method, k) for k in ks for method in methods]:
            engine = run_method(result, path, args.device, method, k, acceptance, batches, prompt, new)
            del engine
            gc.collect()  # an engine's cycles would keep its KV cache: the next engine's budget
            if on_gpu:
                torch.cuda.empty_cache()
    for batch in batches:
        none = rows.get(f"none-b{batch}")
        for k in ks:
            verify, idle = rows.get(f"verify-k{k}-b{batch}"), rows.get(f"mtp-k{k}-a0.0-b{batch}")
            if none and verify:
                verify["step_over_decode"] = verify["step_ms"] / none["step_ms"]
            if none and verify and idle:
                idle["draft_ms"] = idle["step_ms"] - verify["step_ms"]
                idle["draft_over_decode"] = idle["draft_ms"] / none["step_ms"]
            for a in acceptance:
                row, sync = rows.get(f"mtp-k{k}-a{a}-b{batch}"), rows.get(f"mtp-sync-k{k}-a{a}-b{batch}")
                for r in (row, sync):
                    if none and r:
                        r["speedup_over_none"] = r["output_tok_s"] / none["output_tok_s"]
                if row and sync:
                    row["pipelined_over_sync"] = row["output_tok_s"] / sync["output_tok_s"]
    write_result(args.out, result)
    if result["errors"]:
        print("errors:", json.dumps(result["errors"], indent=1))
    return result


if __name__ == "__main__":
    main()
