"""Routing policies as plain functions over replica statistics (testable without Ray).

Decode: prefer the replica with the most free KV blocks, then the fewest running requests.
Prefill: prefer the replica that most recently served the longest prefix of this prompt's block
hashes (its prefix cache likely still holds it), unless that replica's queue is longer than the
shortest queue by more than ``imbalance``; otherwise the shortest queue."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


def rank_decode(stats: dict[str, dict[str, Any]], candidates: Sequence[str]) -> list[list[str]]:
    """Candidates ranked best first; replicas that have not reported yet come last."""
    known = [c for c in candidates if stats.get(c)]
    unknown = [c for c in candidates if not stats.get(c)]
    known.sort(key=lambda c: (-int(stats[c].get("free_blocks", 0)), int(stats[c].get("running", 0)),
                              int(stats[c].get("waiting", 0))))
    ranks = [[c] for c in known]
    if unknown:
        ranks.append(unknown)
    return ranks


class PrefixAffinity:
    """Remembers which replica served which block hashes (bounded, least recently used out)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()

    def record(self, block_hashes: Sequence[int], replica: str) -> None:
        for h in block_hashes:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def matched_blocks(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Replica -> how many leading blocks of the prompt it served."""
        matched: dict[str, int] = {}
        for i, h in enumerate(block_hashes):
            owner = self._owner.get(h)
            if owner is None:
                break
            matched[owner] = i + 1
        return matched

    def forget(self, replica: str) -> None:
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]


def rank_prefill(queue_lens: dict[str, int], candidates: Sequence[str], affinity: PrefixAffinity,
                 block_hashes: Sequence[int], imbalance: int = 4) -> list[list[str]]:
    if not candidates:
        return []
    shortest = min(queue_lens.get(c, 0) for c in candidates)
    matched = affinity.matched_blocks(block_hashes)
    balanced = [c for c in candidates if queue_lens.get(c, 0) <= shortest + imbalance]
    best_match = max((matched.get(c, 0) for c in balanced), default=0)
    ranks: list[list[str]] = []
    if best_match > 0:
        ranks.append([c for c in balanced if matched.get(c, 0) == best_match])
    rest = [c for c in candidates if not ranks or c not in ranks[0]]
    rest.sort(key=lambda c: queue_lens.get(c, 0))
    ranks.extend([c] for c in rest)
    return ranks
