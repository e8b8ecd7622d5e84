"""What the run says of samples it does not write as given: ``rejected.jsonl`` (written as samples
are rejected, published when the index completes), and warnings about samples written with part of
their record left out (logged once per kind, counted in ``run_finished``)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from job.layout import REJECTED
from job.storage.base import IndexStore


class Rejections:
    def __init__(self, path: Path, log: Any) -> None:
        self.path = path
        self._file = path.open("w", encoding="utf-8")
        self._lock = threading.Lock()
        self._log = log
        self.count = 0
        self.reasons: Counter[str] = Counter()

    def add(self, sample_id: str, reason: str) -> None:
        """Record one rejected sample (any thread)."""
        with self._lock:
            self.count += 1
            self.reasons[reason] += 1
            self._file.write(
                json.dumps({"sample_id": sample_id, "reason": reason}, ensure_ascii=False) + "\n"
            )
        self._log.warning("sample_rejected", sample_id=sample_id, reason=reason)

    def most_common(self, n: int = 3, width: int = 160) -> str:
        """The ``n`` most frequent reasons, each shortened to ``width`` characters, with counts."""
        return "; ".join(
            f"{count} x {reason if len(reason) <= width else reason[: width - 3] + '...'}"
            for reason, count in self.reasons.most_common(n)
        )

    def publish(self, store: IndexStore) -> None:
        self.close()
        store.put_file(self.path, REJECTED)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


class SampleWarnings:
    """Counts each kind of warning; the first sample of each kind is logged, as one line per
    sample would flood the log of a run over millions."""

    def __init__(self, log: Any) -> None:
        self._lock = threading.Lock()
        self._log = log
        self.counts: Counter[str] = Counter()

    def add(self, sample_id: str, warning: str) -> None:
        """Record one sample's warning (any thread)."""
        with self._lock:
            self.counts[warning] += 1
            first = self.counts[warning] == 1
        if first:
            self._log.warning(
                "sample_warning",
                sample_id=sample_id,
                warning=warning,
                note="the first sample with this warning; run_finished counts them all",
            )
