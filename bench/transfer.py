"""KV transfer between a prefill (sender) and a decode (receiver) process, per request size.

Two processes started with torch.multiprocessing (spawn) hold Qwen3-8B-shaped KV pools (36 layers,
8 KV heads, head_dim 128, bf16, block_size 16: a block row is 2,359,296 bytes) big enough for a
32k-token request plus 256 blocks of slack. For a request of N tokens (1k..32k), random scattered
block tables on both sides (block 0 is the null block) become BlockCopy lists through
``plan_block_copies``, as in the cluster. All memory holds random bytes, never zeros: sender block
``b`` is one random row rotated by ``b``, so any process can rebuild any block's expected bytes.
The receiver poisons its destination blocks before each size and, after the timed sends, compares
them on its side with the sender's source blocks (``mismatched_blocks`` 0, ``correct`` true).

Sections, each in a fresh pair of processes (the sender drives the receiver through a pipe), each
recording its own error:
- anchors: ``d2d``, a 2 GiB ``copy_`` inside the sender (and onto the receiver's GPU if another),
  as bytes moved / s and bytes read + written / s; ``raw_ipc``, the receiver exports a buffer with
  ``reduce_tensor``, the sender maps it with ``rebuild_cuda_tensor`` and copies the request's bytes
  with one contiguous ``copy_`` (CPU: a shared-memory segment). Backends are compared with raw_ipc.
- ipc, nixl, nccl: ``backend.send`` of the request's blocks, marked last. ``send_ms``: until send
  returned and the sender's devices are synchronized (ipc, nixl: the bytes are in the receiver's
  memory then; nccl: the sender's kernels are done). ``e2e_ms`` also covers the receiver's
  ``wait_received``, asked and answered through the pipe (adds a round trip, ~0.1 ms). nccl needs
  two GPUs (NCCL cannot pair two ranks on one device); Gloo on CPU.
GB/s = payload bytes (blocks x block bytes) / median of ``repeats`` timed runs after warm-up (at
least ``min_repeats`` where one size would take over ``size_budget_s``).

    python3 bench/transfer.py --out bench/results/transfer-h200-<date>.json          # one GPU
    python3 bench/transfer.py --devices 0,1 --out bench/results/transfer-h200x2-<date>.json
    python3 bench/transfer.py --cpu --out /tmp/transfer-cpu.json                       # tests
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import itertools
import json
import os
import queue
import random
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import torch
import torch.multiprocessing as tmp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, median  # noqa: E402
from cluster.common.kv_spec import KVGroupSpec  # noqa: E402
from cluster.kv_transfer import BlockCopy, KVStorage, TransferEndpoint  # noqa: E402
from cluster.kv_transfer.base import rows  # noqa: E402
from cluster.kv_transfer.plan import plan_block_copies  # noqa: E402

CTX = tmp.get_context("spawn")
GB = 1e9
SENDER_SEED, RECEIVER_SEED = 1, 2
IPC_TARGET = 0.8  # issue 5: ipc >= 0.8x of the raw CUDA IPC copy
BACKENDS = ("ipc", "nixl", "nccl")
Samples = list[tuple[float, ...]]


@dataclasses.dataclass(frozen=True)
class Config:
    tokens: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)
    layers: int = 36
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    slack_blocks: int = 256
    warmup: int = 2
    repeats: int = 10
    min_repeats: int = 3
    size_budget_s: float = 8.0
    section_budget_s: float = 90.0  # a backend section skips the sizes left past this
    d2d_bytes: int = 2 << 30
    timeout_s: float = 60.0  # one transfer, one receiver wait

    @property
    def spec(self) -> KVGroupSpec:
        shape = (2, self.block_size, self.kv_heads, self.head_dim)
        return KVGroupSpec("attn", "full", self.layers, shape, "bfloat16", self.block_size)

    @property
    def max_rows(self) -> int:
        return self.spec.blocks_needed(max(self.tokens))


CPU_CONFIG = Config(tokens=(256, 512, 1024, 2048), layers=4, kv_heads=2, head_dim=64, slack_blocks=32,
                    warmup=1, repeats=5, size_budget_s=2.0, section_budget_s=20.0, d2d_bytes=64 << 20)


def pattern(seed: int, n: int, device: torch.device) -> torch.Tensor:
    """``n`` random bytes in [1, 255] from a CPU generator: the same in every process."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=gen, dtype=torch.uint8).to(device)


def fill(table: torch.Tensor, base: torch.Tensor, ids: list[int] | range) -> None:
    """Row ``b`` of ``table`` (uint8 ``[blocks, bytes]``) := ``base`` rotated by ``b``."""
    for b in ids:
        table[b].copy_(base.roll(b))


def mismatches(table: torch.Tensor, base: torch.Tensor, got: list[int] | range, expected: list[int] | range) -> int:
    """How many rows ``table[got[i]]`` differ from pattern row ``expected[i]``."""
    bad = torch.zeros((), dtype=torch.int64, device=table.device)
    for g, e in zip(got, expected):
        bad += (table[g] != base.roll(e)).any()
    return int(bad)


def block_tables(cfg: Config, tokens: int) -> tuple[list[int], list[int]]:
    """Scattered block tables of a ``tokens``-long request on the sender and on the receiver."""
    n, rng, pool = cfg.spec.blocks_needed(tokens), random.Random(tokens), range(1, cfg.max_rows + cfg.slack_blocks + 1)
    return rng.sample(pool, n), rng.sample(pool, n)


class Side:
    """One process's memory (a KV pool, or a raw buffer for the anchor) and backend."""

    def __init__(self, role: str, cfg: Config, kind: str, device: str, peer: str) -> None:
        self.role, self.cfg, self.kind = role, cfg, kind
        self.device, self.peer = torch.device(device), torch.device(peer)
        self.sync_devices = [self.device] if self.device.type == "cuda" else []
        if not self.sync_devices:
            torch.set_num_threads(1)  # CPU runs are functional tests: two processes, few cores
        else:
            torch.cuda.set_device(self.device)
            if role == "sender" and kind in ("raw", "ipc") and self.peer != self.device:
                self.sync_devices.append(self.peer)  # its copies write the receiver's GPU
        self.base = pattern(SENDER_SEED if role == "sender" else RECEIVER_SEED, cfg.spec.bytes_per_block, self.device)
        self.expected = pattern(SENDER_SEED, cfg.spec.bytes_per_block, self.device)
        self.backend: Any = None
        self.shm: shared_memory.SharedMemory | None = None
        self.remote: torch.Tensor | None = None

    def sync(self) -> None:
        for d in self.sync_devices:
            torch.cuda.synchronize(d)

    def setup(self) -> Any:
        """Allocate and fill memory, build the backend; the receiver returns what the sender needs."""
        cfg, spec = self.cfg, self.cfg.spec
        if self.kind == "raw":
            shape = (cfg.max_rows, spec.bytes_per_block)
            if self.role == "receiver" and self.device.type == "cpu":
                self.shm = shared_memory.SharedMemory(create=True, size=shape[0] * shape[1],
                                                      name=f"pdc-bench-{uuid.uuid4().hex[:12]}")
                self.table = torch.frombuffer(self.shm.buf, dtype=torch.uint8).view(shape)
            else:
                self.table = torch.empty(shape, dtype=torch.uint8, device=self.device)
            fill(self.table, self.base, range(cfg.max_rows))
            self.sync()
            if self.role == "sender" or self.shm is not None:
                return self.shm and self.shm.name
            from torch.multiprocessing.reductions import reduce_tensor
            return reduce_tensor(self.table)[1]
        engine_id = f"{self.role}-{uuid.uuid4().hex[:8]}"
        options: dict[str, Any] = {"timeout_s": cfg.timeout_s} if self.kind == "nccl" else {}
        storage = KVStorage(self.kind, engine_id, **options)
        caches = storage.allocate([spec], [cfg.max_rows + cfg.slack_blocks + 1], self.device, [torch.bfloat16])
        self.table = rows(caches[0])
        fill(self.table, self.base, range(self.table.shape[0]))
        self.sync()
        if self.kind == "nixl":
            from cluster.kv_transfer.nixl import NIXLBackend
            self.backend = NIXLBackend(caches, [spec], engine_id, timeout_s=cfg.timeout_s)
        else:
            self.backend = storage.build(caches, [spec])
        return self.backend.endpoint() if self.role == "receiver" else None

    def copy_once(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[float]:
        t0 = time.perf_counter()
        dst.copy_(src)
        self.sync()
        return (time.perf_counter() - t0,)

    # receiver commands, called by the sender through the pipe
    def poison(self, dst: list[int]) -> None:
        fill(self.table, self.base, dst)
        self.sync()

    def wait(self, key: str) -> None:
        self.backend.wait_received(key, self.cfg.timeout_s)

    def check(self, src: list[int] | range, dst: list[int] | range) -> int:
        return mismatches(self.table, self.expected, dst, src)

    def close(self) -> None:
        self.remote = None
        if self.backend is not None:
            self.backend.close()
            self.backend = None  # destroy agents/threads now, not at interpreter exit
        if self.shm is not None:
            self.table = torch.empty(0)
            try:
                self.shm.close()
                if self.role == "receiver":
                    self.shm.unlink()
            except (BufferError, FileNotFoundError):
                pass


def timed(cfg: Config, once: Callable[[], tuple[float, ...]]) -> Samples:
    """Warm-up, then up to ``repeats`` samples (at least ``min_repeats``) within the size budget."""
    start = time.perf_counter()
    for _ in range(cfg.warmup):
        once()
        if time.perf_counter() - start > cfg.size_budget_s / 2:
            break
    samples: Samples = []
    start = time.perf_counter()
    while len(samples) < cfg.repeats and (len(samples) < cfg.min_repeats
                                          or time.perf_counter() - start < cfg.size_budget_s):
        samples.append(once())
    return samples


def summarize(samples: Samples, nbytes: int) -> dict[str, Any]:
    send = [s[0] for s in samples]
    out: dict[str, Any] = {"repeats": len(send), "send_ms": 1e3 * median(send), "min_ms": 1e3 * min(send),
                           "gb_s": nbytes / median(send) / GB, "all_ms": [round(1e3 * s, 4) for s in send]}
    if len(samples[0]) > 1:
        e2e = median([s[1] for s in samples])
        out.update(e2e_ms=1e3 * e2e, e2e_gb_s=nbytes / e2e / GB)
    return out


def rpc(pipe: Any, *msg: Any) -> Any:
    pipe.send(msg)
    ok, value = pipe.recv()
    if not ok:
        raise RuntimeError(f"receiver: {value}")
    return value


def receiver_main(cfg: Config, kind: str, devices: tuple[str, str], pipe: Any) -> None:
    """Set up, send the endpoint, then run the sender's commands until ``stop``."""
    try:
        side = Side("receiver", cfg, kind, *devices)
        pipe.send((True, side.setup()))
    except Exception:  # noqa: BLE001 - reported to the sender
        pipe.send((False, traceback.format_exc(limit=4)))
        return
    try:
        while (msg := pipe.recv())[0] != "stop":
            try:
                pipe.send((True, getattr(side, msg[0])(*msg[1:])))
            except Exception:  # noqa: BLE001 - reported to the sender
                pipe.send((False, traceback.format_exc(limit=4)))
        side.close()
        pipe.send((True, None))
    except EOFError:  # the sender is gone
        side.close()
    _exit()


def _exit() -> None:
    """Leave without interpreter tear-down: Gloo/NCCL groups left open abort there (SIGABRT)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def sender_main(cfg: Config, kind: str, devices: tuple[str, str], pipe: Any, results: Any) -> None:
    """Set up, run the section against the receiver, report its dict (or the error) to the parent."""
    try:
        side = Side("sender", cfg, kind, *devices)
        side.setup()
        ok, info = pipe.recv()
        if not ok:
            raise RuntimeError(f"receiver set-up failed: {info}")
        out = anchor_sizes(side, pipe, info) if kind == "raw" else backend_sizes(side, pipe, info)
        side.close()  # unmap the receiver's memory before it frees it
        rpc(pipe, "stop")
    except Exception:  # noqa: BLE001 - the section's error
        out = {"error": traceback.format_exc(limit=6)[-3000:]}
    results.put(out)
    results.close()
    results.join_thread()  # the result is in the pipe before the process leaves
    _exit()


def anchor_sizes(side: Side, pipe: Any, info: Any) -> dict[str, Any]:
    cfg, n = side.cfg, side.cfg.d2d_bytes
    out: dict[str, Any] = {"d2d": {"bytes": n}, "raw_ipc": {}}
    src = torch.randint(1, 256, (n,), dtype=torch.uint8, device=side.device)
    for label, dev in [("same_device", side.device)] + [("to_peer_device", side.peer)] * (side.peer != side.device):
        dst = torch.empty(n, dtype=torch.uint8, device=dev)
        t = median([s[0] for s in timed(cfg, lambda: side.copy_once(dst, src))])
        out["d2d"][label] = {"ms": 1e3 * t, "moved_gb_s": n / t / GB, "read_written_gb_s": 2 * n / t / GB,
                             "correct": bool(torch.equal(dst.to(side.device), src))}
    del src, dst
    if side.device.type == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        side.remote = rebuild_cuda_tensor(*info)
    else:
        side.shm = shared_memory.SharedMemory(name=info)  # the receiver unlinks it
        side.remote = torch.frombuffer(side.shm.buf, dtype=torch.uint8).view(side.table.shape)
    remote = side.remote
    for tokens in cfg.tokens:
        r = cfg.spec.blocks_needed(tokens)
        samples = timed(cfg, lambda: side.copy_once(remote[:r], side.table[:r]))
        nbytes = r * cfg.spec.bytes_per_block
        out["raw_ipc"][str(tokens)] = {"tokens": tokens, "bytes": nbytes, **summarize(samples, nbytes)}
    bad = rpc(pipe, "check", range(cfg.max_rows), range(cfg.max_rows))
    return {**out, "raw_ipc_correct": bad == 0, "raw_ipc_mismatched_blocks": bad}


def backend_sizes(side: Side, pipe: Any, endpoint: TransferEndpoint) -> dict[str, Any]:
    cfg, out, keys = side.cfg, {}, itertools.count()
    end, broken = time.monotonic() + cfg.section_budget_s, ""

    def once(copies: list[BlockCopy]) -> tuple[float, float]:
        key = f"{side.kind}-{next(keys)}"
        t0 = time.perf_counter()
        side.backend.send(endpoint, key, copies, last=True)
        side.sync()
        t1 = time.perf_counter()
        rpc(pipe, "wait", key)
        return t1 - t0, time.perf_counter() - t0

    for n in cfg.tokens:
        src, dst = block_tables(cfg, n)
        row: dict[str, Any] = {"tokens": n, "blocks": len(src), "bytes": len(src) * cfg.spec.bytes_per_block}
        out[str(n)] = row
        if broken or time.monotonic() > end:
            row["skipped"] = broken or f"section time budget ({cfg.section_budget_s:.0f} s) spent"
            continue
        try:
            copies = plan_block_copies([cfg.spec], [src], [dst], 0, n)
            assert sum(c.num_blocks for c in copies) == len(src), "plan_block_copies lost blocks"
            rpc(pipe, "poison", dst)
            row.update(summarize(timed(cfg, lambda: once(copies)), row["bytes"]))
            bad = rpc(pipe, "check", src, dst)
            row.update(correct=bad == 0, mismatched_blocks=bad)
        except Exception as exc:  # noqa: BLE001 - recorded; the next size still runs
            row["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
            if isinstance(exc, (EOFError, OSError)):
                broken = f"receiver gone after the error at {n} tokens"
    return {"per_size": out}


def run_pair(cfg: Config, kind: str, devices: tuple[str, str]) -> dict[str, Any]:
    """Run one section in a fresh sender/receiver pair; its result, or why there is none."""
    results, (a, b) = CTX.Queue(), CTX.Pipe()
    procs = [CTX.Process(target=sender_main, args=(cfg, kind, devices, a, results), daemon=True),
             CTX.Process(target=receiver_main, args=(cfg, kind, devices[::-1], b), daemon=True)]
    for p in procs:
        p.start()
    a.close()  # the children hold the ends now: a dead peer shows as EOF
    b.close()
    deadline = time.monotonic() + cfg.section_budget_s + 2 * cfg.timeout_s
    try:
        while True:
            try:
                return {"devices": list(devices), **results.get(timeout=1.0)}
            except queue.Empty:
                if not procs[0].is_alive() and results.empty():
                    return {"devices": list(devices), "error": f"sender died (exit code {procs[0].exitcode})"}
                if time.monotonic() > deadline:
                    return {"devices": list(devices), "error": "no result in time: killed"}
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def add_ratios(results: dict[str, Any]) -> None:
    """Ratios to raw_ipc (where the devices match) and to the d2d copy; the issue-5 verdict."""
    anchor = results.get("anchors", {})
    raw, d2d = anchor.get("raw_ipc", {}), anchor.get("d2d", {}).get("same_device", {}).get("moved_gb_s")
    for name in BACKENDS:
        section = results.get(name, {})
        for key, row in section.get("per_size", {}).items():
            if "gb_s" in row and key in raw and section["devices"] == anchor["devices"]:
                row["ratio_to_raw_ipc"] = row["gb_s"] / raw[key]["gb_s"]
            if "gb_s" in row and d2d:
                row["ratio_to_d2d_moved"] = row["gb_s"] / d2d
    ratios = [r.get("ratio_to_raw_ipc") for r in results.get("ipc", {}).get("per_size", {}).values()]
    ok = [r for r in ratios if r is not None]
    results["target"] = {"ipc_ratio_to_raw_ipc_min": IPC_TARGET, "ipc_worst_ratio": min(ok) if ok else None,
                         "met": bool(ok) and len(ok) == len(ratios) and min(ok) >= IPC_TARGET}
    checks = [r["correct"] for s in BACKENDS for r in results.get(s, {}).get("per_size", {}).values() if "correct" in r]
    results["all_transfers_correct"] = all(checks) and anchor.get("raw_ipc_correct", False)


def table(results: dict[str, Any], cfg: Config) -> list[str]:
    anchor = results.get("anchors", {})
    lines = [f"d2d in one process ({k}): {v['moved_gb_s']:.0f} GB/s moved, {v['read_written_gb_s']:.0f} read+written"
             for k, v in anchor.get("d2d", {}).items() if isinstance(v, dict)]
    lines.append(f"{'tokens':>7} {'MB':>7} {'raw ipc':>8} " + " ".join(f"{b:>15}" for b in BACKENDS)
                 + "   (GB/s, ratio to raw ipc; ! = wrong bytes)")
    for n in map(str, cfg.tokens):
        raw = anchor.get("raw_ipc", {}).get(n, {})
        cells = [f"{n:>7} {raw.get('bytes', 0) / 1e6:>7.0f} {raw.get('gb_s', float('nan')):>8.1f}"]
        for name in BACKENDS:
            sec = results.get(name, {})
            row = sec.get("per_size", {}).get(n, {})
            text = next((k for k in ("error", "skipped") if k in row or k in sec), "-")
            if "gb_s" in row:
                text = f"{row['gb_s']:.1f} ({row.get('ratio_to_raw_ipc', float('nan')):.2f}x)" + "!" * (not row["correct"])
            cells.append(f"{text:>15}")
        lines.append(" ".join(cells))
    lines += [f"{name}: " + str(sec.get("error") or sec.get("skipped")).strip().splitlines()[-1][:300]
              for name in ("anchors", *BACKENDS) if "error" in (sec := results.get(name, {})) or "skipped" in sec]
    t = results["target"]
    return lines + [f"ipc >= {IPC_TARGET}x raw ipc: {'met' if t['met'] else 'NOT met'} (worst {t['ipc_worst_ratio']}); "
                    f"all transfers correct: {results['all_transfers_correct']}"]


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"cuda": torch.version.cuda, "env_vars": {
        k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NCCL_", "NIXL_", "CUDA_VIS"))}}
    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    if torch.cuda.is_available():
        out["nccl"] = str(torch.cuda.nccl.version())
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="JSON file (default bench/results/transfer-<gpu|cpu>-<date>.json)")
    parser.add_argument("--cpu", action="store_true", help="CPU processes, small sizes (tests)")
    parser.add_argument("--devices", default="0,0", help="sender GPU,receiver GPU (e.g. 0,1)")
    parser.add_argument("--tokens", default=None, help="request sizes in tokens, comma separated")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--section-budget-s", type=float, default=None, help="backend sections skip sizes past this")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    args = parser.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on the lent machines
    cfg, devices = CPU_CONFIG, ("cpu", "cpu")
    if not args.cpu:
        if not torch.cuda.is_available():
            sys.exit("bench/transfer.py needs a CUDA GPU (or --cpu)")
        s, r = (int(x) for x in args.devices.split(","))
        if max(s, r) >= torch.cuda.device_count():
            sys.exit(f"--devices {args.devices}: only {torch.cuda.device_count()} GPU(s) visible")
        cfg, devices = Config(), (f"cuda:{s}", f"cuda:{r}")
    cfg = dataclasses.replace(cfg, **{k: v for k, v in {
        "tokens": tuple(int(t) for t in args.tokens.split(",")) if args.tokens else None,
        "repeats": args.repeats, "section_budget_s": args.section_budget_s}.items() if v})
    out_path = args.out or f"bench/results/transfer-{'cpu' if args.cpu else 'gpu'}-{datetime.date.today()}.json"
    start = time.monotonic()
    results: dict[str, Any] = {
        "config": {**dataclasses.asdict(cfg), "block_bytes": cfg.spec.bytes_per_block, "dtype": "bfloat16",
                   "pool_blocks": cfg.max_rows + cfg.slack_blocks + 1, "devices": list(devices)},
        "units": "GB/s = 1e9 payload bytes moved per second (blocks x block_bytes / median time); d2d also "
                 "as read+written; ratios: backend GB/s / raw_ipc GB/s at the same size and devices",
    }
    sections: list[tuple[str, str, tuple[str, str]]] = [("anchors", "raw", devices)]
    sections += [(b, b, devices) for b in ("ipc", "nixl") if b in args.backends.split(",")]
    if "nccl" in args.backends.split(","):
        if devices[0] != devices[1] or devices[0] == "cpu":
            sections.append(("nccl", "nccl", devices))
        elif others := [f"cuda:{i}" for i in range(torch.cuda.device_count()) if f"cuda:{i}" != devices[0]]:
            sections.append(("nccl", "nccl", (devices[0], others[0])))
        else:
            results["nccl"] = {"skipped": "one GPU: NCCL cannot pair two ranks on one device (ipc serves that "
                                          "case); run with --devices 0,1 where 2+ GPUs are visible"}
    for name, kind, devs in sections:
        t0 = time.monotonic()
        results[name] = {**run_pair(cfg, kind, devs), "seconds": round(time.monotonic() - t0, 1)}
        print(f"[{name}] {results[name]['seconds']} s{' ERROR' if 'error' in results[name] else ''}", flush=True)
    add_ratios(results)
    results["env"] = {**environment(), **versions()}
    results["total_s"] = round(time.monotonic() - start, 1)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print("\n".join(table(results, cfg)))
    print(f"wrote {out_path} ({results['total_s']} s)")
    return results


if __name__ == "__main__":
    main()
