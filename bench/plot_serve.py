"""Plot one or several bench/serve.py results side by side (e.g. disaggregated vs colocated):

    python bench/plot_serve.py bench/results/serve-disagg.json bench/results/serve-coloc.json \
        --out bench/results/serve-compare.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve import plot_results  # noqa: E402  (bench/ is a folder of scripts, not a package)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Plot bench/serve.py results.")
    p.add_argument("results", nargs="+", help="result JSON files")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args(argv)
    results = []
    for path in args.results:
        with open(path) as f:
            result = json.load(f)
        result["label"] = result.get("label") or os.path.splitext(os.path.basename(path))[0]
        results.append(result)
    plot_results(results, args.out)


if __name__ == "__main__":
    main()
