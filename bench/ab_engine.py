"""Before/after engine speed on this machine: the same decode measurement run from two source
trees (``--a`` and ``--b``, e.g. a worktree of an earlier commit and this checkout), alternating
A and B in fresh processes so that drift of a noisy machine hits both alike. Each process loads
the embedded default model (SmolLM2, the default CPU path), warms up, and times engine steps once
every request of a batch is decoding; the result is the median step time per batch size and
tree, and the ratio B / A.

    python bench/ab_engine.py --a /tmp/before --b . --out bench/results/ab-engine-cpu-<date>.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

PROBE = r'''
import json, sys, time
from cluster import LLM, SamplingParams
llm = LLM("smollm2")
engine = llm.engine
out = {}
for batch in BATCHES:
    params = SamplingParams(temperature=0.0, max_tokens=STEPS + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", f"Write a short story about robot number {i}.", params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_work():
        engine.step()
    times.sort()
    out[str(batch)] = times[len(times) // 2]
print("RESULT " + json.dumps(out))
'''


def run_probe(tree: str, batches: list[int], steps: int) -> dict[str, float]:
    code = PROBE.replace("BATCHES", repr(batches)).replace("STEPS", str(steps))
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.abspath(tree), env=env,
                          capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"probe in {tree} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def commit_of(tree: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="source tree before")
    parser.add_argument("--b", required=True, help="source tree after")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=f"bench/results/ab-engine-cpu-{datetime.date.today()}.json")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.common import environment

    batches = [int(b) for b in args.batches.split(",")]
    samples: dict[str, dict[str, list[float]]] = {"a": {}, "b": {}}
    for r in range(args.rounds):
        for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
            result = run_probe(getattr(args, side), batches, args.steps)
            for batch, seconds in result.items():
                samples[side].setdefault(batch, []).append(seconds)
            print(side, r, {k: round(v * 1e3, 2) for k, v in result.items()}, flush=True)
    rows = {}
    for batch in map(str, batches):
        a, b = statistics.median(samples["a"][batch]), statistics.median(samples["b"][batch])
        # each round's two runs follow each other: their ratio cancels a drift slower than a round
        paired = [y / x for x, y in zip(samples["a"][batch], samples["b"][batch])]
        rows[batch] = {"a_step_ms": round(a * 1e3, 3), "b_step_ms": round(b * 1e3, 3),
                       "b_over_a": round(b / a, 3), "paired_b_over_a_median": round(statistics.median(paired), 3),
                       "paired_b_over_a": [round(x, 3) for x in paired], "b_faster_rounds": sum(x < 1 for x in paired), "a_runs_ms": [round(x * 1e3, 2) for x in samples["a"][batch]],
                       "b_runs_ms": [round(x * 1e3, 2) for x in samples["b"][batch]]}
    report = {"benchmark": "ab-engine-cpu", "environment": environment(),
              "a": {"tree": "before", "commit": commit_of(args.a)}, "b": {"tree": "after", "commit": commit_of(args.b)},
              "settings": {"model": "smollm2 (default CPU path: 4-bit projections)", "steps": args.steps,
                           "rounds": args.rounds, "order": "alternating, fresh process per run"},
              "median_decode_step": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
