"""pd-cluster: a Ray-based, prefill/decode-disaggregated LLM serving cluster.

``from cluster import LLM, SamplingParams`` gives the offline API; ``serve run cluster.app`` the
service. Heavy modules load on first use, so importing a light submodule stays light."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cluster.common.outputs import CompletionOutput, RequestOutput
from cluster.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.engine.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from cluster.engine.llm import LLM
        return LLM
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
