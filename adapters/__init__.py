"""vLLM version adapters: the only place that knows how vLLM's internals differ
between releases. ``select_adapter_set`` reads ``config/adapters.yaml`` and
returns the set of small, named pieces of code that fit the installed vLLM.
"""

from adapters.registry import AdapterSet, UnsupportedVllmVersion, load_adapter_sets, select_adapter_set

__all__ = ["AdapterSet", "UnsupportedVllmVersion", "load_adapter_sets", "select_adapter_set"]
