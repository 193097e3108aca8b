"""The speedup curve of DeepSeek-V4 MTP against acceptance, from a bench/v4_mtp_gpu.py result:
one panel per batch, output tok/s over no speculation (same run) for each draft length k, pipelined
verify steps solid, synchronous ones (``--compare-sync`` rows) dashed, with the anchors' published
acceptance marked (DeepSeek-V3's MTP: 85-90% of second tokens; V4: about 3.1 tokens a step with 3
drafts, read here as the per-draft acceptance ``a`` with ``1 + a + a^2 + a^3 = 3.1``).

    python bench/plot_v4_mtp.py bench/results/v4-mtp-h100-2026-12-05-pipelined.json \
        --out bench/results/v4-mtp-h100-2026-12-05-speedup.png
"""
from __future__ import annotations

import argparse
import json
import re
from typing import Any

ROW = re.compile(r"^(mtp|mtp-sync)-k(\d+)-a([0-9.]+)-b(\d+)$")


def per_draft_acceptance(tokens_per_step: float, k: int) -> float:
    """The ``a`` whose expected tokens a step with ``k`` drafts, ``1 + a + ... + a^k``, is
    ``tokens_per_step`` (bisection; the sum grows with ``a``)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(k + 1)) < tokens_per_step:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def curves(result: dict[str, Any]) -> dict[int, dict[tuple[str, int], list[tuple[float, float]]]]:
    """batch -> (path, k) -> sorted (acceptance, speedup over no speculation)."""
    out: dict[int, dict[tuple[str, int], list[tuple[float, float]]]] = {}
    for name, row in result["rows"].items():
        match = ROW.match(name)
        if not match or "speedup_over_none" not in row:
            continue
        path, k, a, batch = match.group(1), int(match.group(2)), float(match.group(3)), int(match.group(4))
        out.setdefault(batch, {}).setdefault((path, k), []).append((a, row["speedup_over_none"]))
    for by_k in out.values():
        for points in by_k.values():
            points.sort()
    return out


def plot(result: dict[str, Any], out: str) -> dict[str, Any]:
    """Write the PNG; returns what it drew (batches, curves, the anchors' acceptances)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = curves(result)
    if not data:
        raise ValueError("the result has no mtp-k*-a*-b* rows with speedup_over_none")
    anchors = result.get("anchors", {})
    v3 = anchors.get("deepseek_v3_mtp_second_token", [0.85, 0.90])
    v4 = per_draft_acceptance(anchors.get("v4_accepted_tokens_per_step_k3", 3.1), 3)
    batches = sorted(data)
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.2), sharey=True, squeeze=False)
    colors = {1: "tab:blue", 2: "tab:orange", 3: "tab:green", 4: "tab:red", 5: "tab:purple"}
    for ax, batch in zip(axes[0], batches):
        ax.axvspan(v3[0], v3[1], color="gold", alpha=0.3, label=f"DeepSeek-V3 MTP: {v3[0]:.0%}-{v3[1]:.0%}")
        ax.axvline(v4, color="black", linestyle=":", label=f"V4: 3.1 tokens/step at k=3 (a={v4:.2f})")
        ax.axhline(1.0, color="gray", linewidth=1, label="no speculation (same run)")
        for (path, k), points in sorted(data[batch].items()):
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", color=colors.get(k, "tab:gray"), linestyle="-" if path == "mtp" else "--",
                    label=f"k={k}" + (" synchronous" if path == "mtp-sync" else " pipelined"))
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("acceptance per draft (set)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("output tok/s over no speculation")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    device = result.get("environment", {}).get("device", "")
    fig.suptitle(f"DeepSeek-V4 MTP at V4-Flash width, random weights, acceptance set ({device}; "
                 f"commit {result.get('environment', {}).get('commit', '?')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return {"batches": batches, "curves": {b: {f"{p}-k{k}": v for (p, k), v in c.items()} for b, c in data.items()},
            "v3_band": v3, "v4_per_draft_acceptance": v4}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", help="a bench/v4_mtp_gpu.py JSON")
    parser.add_argument("--out", required=True, help="PNG to write")
    args = parser.parse_args(argv)
    with open(args.result) as f:
        result = json.load(f)
    return plot(result, args.out)


if __name__ == "__main__":
    main()
