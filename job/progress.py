"""Progress of this index's extraction in tokens: periodic ``progress`` events, and a bar when
stderr is a terminal.

The index's total is known exactly once every sample is planned (tokenized and given a
shard); until then it is estimated from the tokens planned per input byte read so far.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Snapshot:
    extracted_tokens: int  # rows the backend returned this run
    extracted_samples: int
    planned_tokens: int  # tokens of the samples given a shard so far
    input_fraction: float  # of the input's bytes read
    all_planned: bool  # the input is exhausted: planned_tokens is this run's total
    written: int  # samples committed (all runs)
    rejected: int
    generated_tokens: int = 0  # by regeneration (generate.mode), this run

    @property
    def total_tokens(self) -> int | None:
        if self.all_planned:
            return self.planned_tokens
        if self.input_fraction <= 0:
            return None
        return max(self.planned_tokens, round(self.planned_tokens / self.input_fraction))


class Progress:
    def __init__(self, log: Any, interval_s: float) -> None:
        self._log = log
        self._interval = interval_s
        self._start = time.monotonic()
        self._last = self._start
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(unit="tok", unit_scale=True, desc="extracted", leave=False, dynamic_ncols=True)

    def maybe_report(self, now_state: Snapshot) -> None:
        now = time.monotonic()
        total = now_state.total_tokens
        if self._bar is not None:
            self._bar.total = total
            self._bar.n = now_state.extracted_tokens
            self._bar.set_postfix(
                samples=now_state.extracted_samples, written=now_state.written, refresh=False
            )
            self._bar.refresh()
        if now - self._last < self._interval:
            return
        self._last = now
        elapsed = now - self._start
        rate = now_state.extracted_tokens / elapsed if elapsed > 0 else 0.0
        eta = (total - now_state.extracted_tokens) / rate if total is not None and rate > 0 else None
        self._log.info(
            "progress",
            samples=now_state.extracted_samples,
            tokens=now_state.extracted_tokens,
            total_tokens=total,
            total_exact=now_state.all_planned,
            tok_per_s=round(rate, 1),
            written=now_state.written,
            rejected=now_state.rejected,
            generated_tokens=now_state.generated_tokens,
            input_fraction=round(now_state.input_fraction, 4),
            eta_s=None if eta is None else round(max(eta, 0.0), 1),
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
