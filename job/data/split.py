"""Deterministic work split: every sample id belongs to exactly one index."""

from __future__ import annotations

import hashlib


def owner_index(sample_id: str, count: int) -> int:
    """The work index that owns ``sample_id`` among ``count`` indexes.

    A hash of the id, not its position: adding or reordering input files does
    not move samples that were already assigned.
    """
    digest = hashlib.blake2b(sample_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count
