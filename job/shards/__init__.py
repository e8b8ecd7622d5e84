"""Shards: the pinned format and what fixes a shard's layout (``format``), writing (``writer``)
and reading: one sample by its place (``access.OutputReader``), a whole output in order
(``reader.iter_output``), a training dataset over it (``dataset.OutputDataset``). The reading
side imports neither vLLM nor the job's settings.

>>> from job.shards import iter_output
>>> for sample in iter_output("out"):           # every committed shard of every index
...     sample.hidden_states.shape             # [T, L, H], layers in sample.layer_ids order
"""

from job.shards.access import OutputReader
from job.shards.dataset import (
    IncompleteOutputWarning,
    OutputChanged,
    OutputDataset,
    OutputIncomplete,
    OutputStalled,
)
from job.shards.reader import Sample, Shard, iter_output, open_shard, read_manifest

__all__ = [
    "IncompleteOutputWarning",
    "OutputChanged",
    "OutputDataset",
    "OutputIncomplete",
    "OutputReader",
    "OutputStalled",
    "Sample",
    "Shard",
    "iter_output",
    "open_shard",
    "read_manifest",
]
