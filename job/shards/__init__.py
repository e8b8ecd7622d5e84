"""Shards: the pinned format and what fixes a shard's layout (``format``), writing (``writer``)
and reading (``reader``, re-exported here).

>>> from job.shards import iter_output
>>> for sample in iter_output("out"):           # every committed shard of every index
...     sample.hidden_states.shape             # [T, L, H], layers in sample.layer_ids order
"""

from job.shards.reader import Sample, Shard, iter_output, open_shard, read_manifest

__all__ = ["Sample", "Shard", "iter_output", "open_shard", "read_manifest"]
