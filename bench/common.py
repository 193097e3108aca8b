"""Shared helpers for benchmark scripts: environment facts recorded next to every result, and
robust statistics."""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
from typing import Any


def environment() -> dict[str, Any]:
    import torch
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # PD_BENCH_COMMIT: the commit a copied tree was made from, where the copy's git is stale
        "commit": os.environ.get("PD_BENCH_COMMIT") or _git("rev-parse", "HEAD"),
        "dirty": False if os.environ.get("PD_BENCH_COMMIT") else bool(_git("status", "--porcelain")),
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    else:
        info["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return info


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
