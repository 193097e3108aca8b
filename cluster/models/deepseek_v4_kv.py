"""DeepSeek-V4's KV state as KV groups of the engine's cache manager, and where each layer's
state lives in them. Everything a request carries between steps is in these groups, so copying a
request's blocks of every group moves its whole state (prefill -> decode transfer).

Groups (only those with layers are declared):
- ``swa`` (sliding_window, every layer): the shared K=V entry ``[head_dim]`` of each of the last
  ``sliding_window`` tokens; blocks behind the window are freed.
- ``csa_kv`` / ``csa_index`` (compressed, ratio ``csa_ratio``, CSA layers): the compressed KV entries
  ``[head_dim]`` and the lightning indexer's compressed keys ``[index_head_dim]``.
- ``hca_kv`` (compressed, ratio ``hca_ratio``, HCA layers): the compressed KV entries.
- ``csa_state`` / ``hca_state`` (state, float32): the compressors' partial windows. A window is
  pooled by a per-channel softmax over its tokens' gates, which folds into a running
  ``(log-sum-exp, weighted mean)`` pair per channel; a checkpoint holds those pairs for the
  window in progress. CSA windows overlap (entry ``w`` pools window ``w - 1``'s first half-channels
  and window ``w``'s second half), so a CSA checkpoint holds two accumulators: ``[0]`` the entry
  in progress (previous window's overlap part merged with this window's tokens so far), ``[1]``
  this window's overlap part so far. The compressor's and the indexer's channels sit side by side
  (``head_dim + index_head_dim``): both pool the same windows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.common.kv_spec import KVGroupSpec
from cluster.models.deepseek_v4_config import CSA, HCA, DeepseekV4Args

STATE_DTYPE = "float32"


def entries_per_block(block_size: int, ratio: int) -> int:
    """Compressed entries per block: the fewest whose tokens fill whole cache blocks."""
    return math.lcm(block_size, ratio) // ratio


def deepseek_v4_kv_specs(args: DeepseekV4Args, block_size: int, dtype: str) -> list[KVGroupSpec]:
    specs = [KVGroupSpec("swa", "sliding_window", args.num_layers, (block_size, args.head_dim), dtype,
                         block_size, sliding_window=args.sliding_window)]
    if args.num_csa_layers:
        n, r = args.num_csa_layers, args.csa_ratio
        epb = entries_per_block(block_size, r)
        specs += [
            KVGroupSpec("csa_kv", "compressed", n, (epb, args.head_dim), dtype, epb, compress_ratio=r),
            KVGroupSpec("csa_index", "compressed", n, (epb, args.index_head_dim), dtype, epb, compress_ratio=r),
            KVGroupSpec("csa_state", "state", n, (2, 2, args.head_dim + args.index_head_dim), STATE_DTYPE,
                        block_size),
        ]
    if args.num_hca_layers:
        n, r = args.num_hca_layers, args.hca_ratio
        epb = entries_per_block(block_size, r)
        specs += [
            KVGroupSpec("hca_kv", "compressed", n, (epb, args.head_dim), dtype, epb, compress_ratio=r),
            KVGroupSpec("hca_state", "state", n, (2, args.head_dim), STATE_DTYPE, block_size),
        ]
    return specs


@dataclass(frozen=True)
class LayerKV:
    """Where one layer's state lives: ``(group, layer index within the group)`` per part."""

    window: tuple[int, int]
    compressed: tuple[int, int] | None = None
    index: tuple[int, int] | None = None
    state: tuple[int, int] | None = None


def layer_kv_layout(args: DeepseekV4Args, specs: list[KVGroupSpec]) -> list[LayerKV]:
    group = {spec.name: g for g, spec in enumerate(specs)}
    seen = {CSA: 0, HCA: 0}
    layout = []
    for i, kind in enumerate(args.layer_types):
        if kind == CSA:
            k = seen[CSA]
            layout.append(LayerKV((group["swa"], i), (group["csa_kv"], k), (group["csa_index"], k),
                                  (group["csa_state"], k)))
        elif kind == HCA:
            k = seen[HCA]
            layout.append(LayerKV((group["swa"], i), (group["hca_kv"], k), None, (group["hca_state"], k)))
        else:
            layout.append(LayerKV((group["swa"], i)))
        seen[kind] = seen.get(kind, 0) + 1
    return layout
