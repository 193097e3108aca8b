"""Which blocks to copy for a range of tokens: maps a sender's block tables onto a receiver's,
group by group, for the blocks whose entries the tokens ``[start, end)`` wrote."""
from __future__ import annotations

from cluster.common.kv_spec import KVGroupSpec
from cluster.kv_transfer.base import BlockCopy

NULL_BLOCK = 0


def written_blocks(spec: KVGroupSpec, start: int, end: int) -> range:
    """Indices of the blocks that computing tokens ``[start, end)`` writes in a group."""
    if end <= start:
        return range(0)
    first_entry = spec.num_entries(start) if spec.kind == "compressed" else start
    last_entry = spec.num_entries(end) if spec.kind == "compressed" else end
    if last_entry <= first_entry and spec.kind == "compressed":
        return range(0)
    return range(first_entry // spec.block_size, -(-last_entry // spec.block_size))


def plan_block_copies(specs: list[KVGroupSpec], src_tables: list[list[int]], dst_tables: list[list[int]],
                      start: int, end: int) -> list[BlockCopy]:
    copies = []
    for g, spec in enumerate(specs):
        src, dst = src_tables[g], dst_tables[g]
        pairs = [(src[j], dst[j]) for j in written_blocks(spec, start, end)
                 if j < len(src) and j < len(dst) and src[j] != NULL_BLOCK and dst[j] != NULL_BLOCK]
        if pairs:
            copies.append(BlockCopy(g, [s for s, _ in pairs], [d for _, d in pairs]))
    return copies
