"""Periodic ``progress`` events (and a bar when stderr is a terminal)."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    def __init__(self, log: Any, interval_s: float, total_input_bytes: int) -> None:
        self._log = log
        self._interval = interval_s
        self._total = max(total_input_bytes, 1)
        self._start = time.monotonic()
        self._last = self._start
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self._total, unit="B", unit_scale=True, desc="input", leave=False)

    def maybe_report(self, tokens: int, samples: int, bytes_done: int, written: int, rejected: int) -> None:
        """``tokens``/``samples`` extracted this run, ``bytes_done`` of the input read."""
        now = time.monotonic()
        if self._bar is not None:
            self._bar.n = min(bytes_done, self._total)
            self._bar.set_postfix(samples=samples, tokens=tokens, refresh=False)
            self._bar.refresh()
        if now - self._last < self._interval:
            return
        self._last = now
        elapsed = now - self._start
        fraction = min(bytes_done / self._total, 1.0)
        eta = elapsed * (1 - fraction) / fraction if fraction > 0 else None
        self._log.info(
            "progress",
            samples=samples,
            tokens=tokens,
            tok_per_s=round(tokens / elapsed, 1) if elapsed > 0 else None,
            written=written,
            rejected=rejected,
            input_fraction=round(fraction, 4),
            eta_s=None if eta is None else round(eta, 1),
        )
