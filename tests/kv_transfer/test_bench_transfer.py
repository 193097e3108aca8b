"""bench/transfer.py: its ``--cpu`` path runs end to end (shared-memory ipc, NIXL on DRAM, Gloo
nccl) and writes every figure and correctness check to its JSON; and the check it relies on
catches bytes that did not arrive or landed in the wrong block."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from bench.transfer import CPU_CONFIG, block_tables, fill, mismatches, pattern

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _nixl_available() -> bool:
    try:
        from cluster.kv_transfer.nixl import _import_nixl
        _import_nixl()
        return True
    except Exception:  # noqa: BLE001 - not installed
        return False


def test_correctness_check_catches_missing_and_misplaced_blocks():
    spec = CPU_CONFIG.spec
    sent, poison = pattern(1, spec.bytes_per_block, torch.device("cpu")), pattern(2, spec.bytes_per_block, torch.device("cpu"))
    assert sent.min() > 0 and not torch.equal(sent, poison)  # random, never zeros
    src, dst = block_tables(CPU_CONFIG, 1024)
    assert len(src) == spec.blocks_needed(1024) and src != sorted(src) and 0 not in src + dst  # scattered, no null block
    table = torch.empty((CPU_CONFIG.max_rows + CPU_CONFIG.slack_blocks + 1, spec.bytes_per_block), dtype=torch.uint8)
    fill(table, poison, range(table.shape[0]))
    assert mismatches(table, sent, dst, src) == len(dst)  # nothing arrived
    for s, d in zip(src, dst):
        table[d] = sent.roll(s)
    assert mismatches(table, sent, dst, src) == 0
    table[dst[3], 17] ^= 1  # one flipped bit
    table[[dst[5], dst[6]]] = table[[dst[6], dst[5]]].clone()  # two blocks swapped
    assert mismatches(table, sent, dst, src) == 3


def test_cpu_run_writes_every_figure(tmp_path):
    out = tmp_path / "transfer.json"
    proc = subprocess.run([sys.executable, "bench/transfer.py", "--cpu", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    tokens = [str(t) for t in CPU_CONFIG.tokens]
    assert {"date", "commit", "torch", "device", "python"} <= set(res["env"])
    assert res["config"]["block_bytes"] == CPU_CONFIG.spec.bytes_per_block

    anchors = res["anchors"]
    assert "error" not in anchors, anchors.get("error")
    assert anchors["d2d"]["same_device"]["moved_gb_s"] > 0 and anchors["d2d"]["same_device"]["correct"]
    assert anchors["raw_ipc_correct"] and anchors["raw_ipc_mismatched_blocks"] == 0
    assert set(anchors["raw_ipc"]) == set(tokens) and all(r["gb_s"] > 0 for r in anchors["raw_ipc"].values())

    checked = ["ipc", "nccl"] + (["nixl"] if _nixl_available() else [])
    for name in checked:
        section = res[name]
        assert "error" not in section, (name, section.get("error"))
        for n in tokens:
            row = section["per_size"][n]
            assert "error" not in row and "skipped" not in row, (name, n, row)
            assert row["correct"] and row["mismatched_blocks"] == 0, (name, n, row)
            assert row["blocks"] == CPU_CONFIG.spec.blocks_needed(int(n))
            assert row["bytes"] == row["blocks"] * CPU_CONFIG.spec.bytes_per_block
            assert row["repeats"] >= CPU_CONFIG.min_repeats and len(row["all_ms"]) == row["repeats"]
            assert row["gb_s"] > 0 and row["e2e_ms"] >= row["send_ms"] > 0
            assert row["ratio_to_raw_ipc"] > 0 and row["ratio_to_d2d_moved"] > 0
    if "nixl" not in checked:
        assert "error" in res["nixl"]  # NIXL missing is recorded, not fatal
    assert res["all_transfers_correct"] is True
    assert res["target"]["ipc_ratio_to_raw_ipc_min"] == 0.8 and isinstance(res["target"]["met"], bool)
    assert "ipc >= 0.8x raw ipc" in proc.stdout
