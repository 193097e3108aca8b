"""EngineClient: what the OpenAI HTTP layer needs from whatever serves it (the Ray ingress in
production; an in-process engine in tests). One method streams one prompt's ``n`` samples (one
routed call, one prefill); the HTTP layer fans out prompt lists itself."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from cluster.common.messages import GenerateRequest, ReplicaStats, StepOutput
from cluster.models.tokenizer import Tokenizer


class EngineClient(Protocol):
    #: The name clients pass as ``model``.
    model_name: str
    max_model_len: int
    #: The model's vocabulary size (token ids in prompts must be below it).
    vocab_size: int
    tokenizer: Tokenizer

    def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        """Stream the outputs of the request's ``sampling_params.n`` samples (``StepOutput.sample_index``
        names the sample), until each has finished. Admission failures raise a ClusterError
        (InvalidRequestError, OverloadedError, ...) before the first output; later failures end
        a sample with a StepOutput whose finish_reason is "error" (or "abort" on a deadline).
        Cancelling the iteration (client disconnect) aborts the request everywhere."""
        ...

    async def health(self) -> None:
        """Raise if the service cannot take requests (GET /health). Answers from what the client
        already knows: it never waits on a busy replica."""
        ...

    async def replica_stats(self) -> list[ReplicaStats]:
        """Latest gauges of every prefill/decode replica (for /metrics)."""
        ...

    async def backends(self) -> list[dict[str, Any]]:
        """The resolved kernel choice of every component of every replica (GET /v1/backends)."""
        ...
