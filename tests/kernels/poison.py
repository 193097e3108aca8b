"""Poisoned allocations: while active, ``torch.empty`` / ``torch.empty_like`` hand out memory
filled with NaN (floats), a large sentinel (integers) or True (bool), so a kernel that leaves part
of an output or scratch buffer unwritten shows up in the result."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif t.dtype.is_signed or t.dtype == torch.uint8:
        t.fill_(torch.iinfo(t.dtype).max // 3)
    return t


@contextmanager
def poisoned_allocations() -> Iterator[None]:
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        return poison(real_empty(*args, **kwargs))

    def empty_like(*args: Any, **kwargs: Any) -> torch.Tensor:
        return poison(real_empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = empty, empty_like  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like  # type: ignore[assignment]
