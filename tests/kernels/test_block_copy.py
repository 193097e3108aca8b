"""The one-pass block copy against its reference: random rows, scattered ids, rows of several
widths (int64, int32 and byte-sized words)."""
from __future__ import annotations

import pytest
import torch

from kernels.block_copy import copy_blocks_ref, row_words
from kernels.triton_block_copy import copy_blocks_triton


@pytest.mark.parametrize("row_shape, dtype", [((2, 4, 2, 8), torch.bfloat16), ((3, 5), torch.float32),
                                              ((7,), torch.uint8)])
def test_copy_blocks_matches_reference(row_shape, dtype):
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(1, 120, (10, *row_shape), generator=gen).to(dtype)
    dst = torch.randint(1, 120, (12, *row_shape), generator=gen).to(dtype)
    src_ids = torch.tensor([3, 0, 9, 4])
    dst_ids = torch.tensor([11, 2, 5, 0])
    want, got = dst.clone(), dst.clone()
    copy_blocks_ref(src, want, src_ids, dst_ids)
    copy_blocks_triton(src, got, src_ids, dst_ids)
    assert torch.equal(got, want)


def test_row_words_picks_the_widest_word():
    assert row_words(torch.zeros(4, 16, dtype=torch.bfloat16)).dtype == torch.int64
    assert row_words(torch.zeros(4, 3, dtype=torch.float32)).dtype == torch.int32
    assert row_words(torch.zeros(4, 7, dtype=torch.uint8)).dtype == torch.uint8
