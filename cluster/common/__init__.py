"""Types shared by every role: sampling parameters, outputs, errors and ids. No torch at import time."""
from __future__ import annotations

from cluster.common.errors import (
    ClusterError,
    EngineDeadError,
    InvalidRequestError,
    KVTransferError,
    ModelLoadError,
    OverloadedError,
    RequestAbortedError,
    RequestTimeoutError,
    UnsupportedArchitectureError,
    UnsupportedSettingError,
)
from cluster.common.outputs import CompletionOutput, Logprob, RequestOutput
from cluster.common.sampling_params import SamplingParams

__all__ = [
    "ClusterError",
    "CompletionOutput",
    "EngineDeadError",
    "InvalidRequestError",
    "KVTransferError",
    "Logprob",
    "ModelLoadError",
    "OverloadedError",
    "RequestAbortedError",
    "RequestOutput",
    "RequestTimeoutError",
    "SamplingParams",
    "UnsupportedArchitectureError",
    "UnsupportedSettingError",
]
