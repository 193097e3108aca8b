"""What the DeepSeek-V4 Triton kernels (``triton_deepseek_v4_attention``, ``triton_deepseek_v4_indexer``)
share: the flat-token batch layout and the per-token lookup of a query's sequence and position.

A batch is a flat run of ``T`` query tokens; sequence ``i`` owns rows ``query_start_loc[i] :
query_start_loc[i + 1]``, its last ``q_len`` positions out of ``seq_lens[i]`` (the layout of
``kernels.deepseek_v4_ref``). Kernels launch one program (or a few) per token and find the token's
sequence by a binary search over ``query_start_loc`` on the device, so their grids depend only on
``T``: no per-sequence host loop and no host synchronization.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def token_sequence(query_start_loc_ptr, t, num_seqs, log_b):
    """The sequence that owns flat token ``t``: the largest ``i < num_seqs`` with
    ``query_start_loc[i] <= t`` (empty sequences before it are skipped), in ``log_b`` steps
    (:func:`log_steps`; a run-time bound, so one compiled kernel serves every batch size)."""
    lo = t * 0
    hi = lo + num_seqs
    for _ in range(log_b):
        mid = (lo + hi) // 2
        go_right = tl.load(query_start_loc_ptr + mid) <= t
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def token_position(query_start_loc_ptr, seq_lens_ptr, t, seq):
    """Position of flat token ``t`` of sequence ``seq`` in its sequence."""
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    return tl.load(seq_lens_ptr + seq) - (q_end - t)


def log_steps(num_seqs: int) -> int:
    """Binary-search steps that :func:`token_sequence` needs for ``num_seqs`` sequences."""
    return max(1, (max(num_seqs, 1)).bit_length())


#: Integer arguments that vary with the batch: not specialised (Triton compiles a variant for
#: values of 1 and for multiples of 16), so a decode graph of any size reuses one compiled kernel.
BATCH_ARGS = ["t_base", "num_seqs", "log_b", "token_bucket"]


def token_bucket(num_tokens: int) -> int:
    """The autotuning key's token class: powers of 4 up to 4096 (1, 4, 16, 64, ...), so the decode
    graph sizes (1, 2, 4, 8, 16, 32, 48, 64, ...) share a few tunings instead of one each."""
    bucket = 1
    while bucket < min(num_tokens, 4096):
        bucket *= 4
    return min(bucket, 4096)


def batch_tensors(device: torch.device, query_start_loc_cpu: list[int], seq_lens_cpu: list[int],
                  query_start_loc: torch.Tensor | None, seq_lens: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's ``query_start_loc [B + 1]`` and ``seq_lens [B]`` on ``device`` (int32): the
    caller's device copies when given (no host-to-device copy), else built from the lists."""
    if query_start_loc is None or query_start_loc.device != device:
        query_start_loc = torch.tensor(query_start_loc_cpu, dtype=torch.int32, device=device)
    if seq_lens is None or seq_lens.device != device:
        seq_lens = torch.tensor(seq_lens_cpu, dtype=torch.int32, device=device)
    return query_start_loc, seq_lens


def next_power_of_2(n: int) -> int:
    return int(triton.next_power_of_2(max(int(n), 1)))
