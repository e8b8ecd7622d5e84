"""``python -m job.speculators COMMAND ...``: speculators' own command line (``speculators
COMMAND ...``, every command and flag unchanged) with the ``eagle3-extract`` hidden-states
backend registered, e.g.

    python -m job.speculators train --data-path DST --hidden-states-backend eagle3-extract ...
    torchrun --nproc-per-node 8 -m job.speculators train ...   # several ranks (not run: no GPU)

speculators 0.9 collects backends' flags when its training config module is first imported,
so the backend must be registered before that: importing ``job.speculators`` (above
speculators' own imports here) does it.
"""

from __future__ import annotations

import job.speculators  # noqa: F401 - registers the backend


def main() -> None:
    from speculators.cli import app

    app(prog_name="python -m job.speculators")


if __name__ == "__main__":
    main()
