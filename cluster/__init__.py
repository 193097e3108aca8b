"""pd-cluster: a Ray-based, prefill/decode-disaggregated LLM serving cluster.

``from cluster import LLM, SamplingParams`` gives the offline API; ``serve run cluster.app`` the
service; ``serve build cluster:default_app`` a Serve config file of it. Heavy modules load on first use, so importing a light submodule stays light."""
from __future__ import annotations

import importlib
from typing import Any

from cluster.common.outputs import CompletionOutput, RequestOutput
from cluster.common.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "app"]


def app(args: dict[str, Any]) -> Any:
    """The Serve application builder: ``serve run cluster.app [key=value ...]``."""
    return importlib.import_module("cluster.application").build_app(args)


def __getattr__(name: str) -> Any:
    if name == "LLM":
        # Imported on first use (and by name, so the package root carries no layer dependency).
        return importlib.import_module("cluster.engine.llm").LLM
    if name == "default_app":
        # `serve build cluster:default_app`: Serve writes config files only from a built
        # Application, not from a builder such as `app` (settings from CLUSTER_* variables).
        return importlib.import_module("cluster.application").build_app({})
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
