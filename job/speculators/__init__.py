"""speculators (0.9) trains on our output without a copy of its hidden states.

``python -m job export --format speculators --hidden-states reference SRC DST`` writes the
token side of the training data (input ids, loss masks, ``token_freq.pt``) and a map from
each row to its sample in SRC's shards; the ``eagle3-extract`` hidden-states backend
(``job.speculators.backend``) hands speculators' data loader each row's hidden states read
from those shards. speculators finds backends by import, so importing this package
registers it; ``python -m job.speculators train ...`` is ``speculators train ...`` with the
backend registered (``job.speculators.__main__``).
"""

from job.speculators.backend import Eagle3ExtractBackend, ReferenceTransfer

__all__ = ["Eagle3ExtractBackend", "ReferenceTransfer"]
