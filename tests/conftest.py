"""Test-wide set-up: without a GPU, Triton kernels run in Triton's CPU interpreter, whichever test
directory imports them first."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
