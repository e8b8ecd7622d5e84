"""vLLM version adapters: the only place that knows how vLLM's internals differ between
releases. ``select_adapter_set`` reads ``config/adapters.yaml`` and returns the
``AdapterSet`` whose facts fit the installed vLLM; its methods are the concerns
(engine, KV cache, scheduler, block hasher, request, step submission, step layout).
"""

from adapters.facts import VllmFacts
from adapters.registry import (
    AdapterSet,
    UnsupportedVllmVersion,
    adapter_set_named,
    load_adapter_sets,
    select_adapter_set,
)

__all__ = [
    "AdapterSet",
    "UnsupportedVllmVersion",
    "VllmFacts",
    "adapter_set_named",
    "load_adapter_sets",
    "select_adapter_set",
]
