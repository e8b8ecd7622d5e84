"""Every command in README.md runs as written: the commands of its ``bash`` blocks and the ``$ ``
lines of its other blocks, in the README's order, in one scratch directory where ``python`` and
``.venv/bin/python`` are this interpreter; where the README shows a command's output, its first
line is the command's. A command whose steps (``a && b``) cannot run here is listed in
``ELSEWHERE`` with why; every entry there must still be in the README.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

# The start of each step that cannot run in this test, and why.
ELSEWHERE = {
    "python3 -m venv .venv": "makes a venv for the next step to fill; this interpreter stands in for it",
    ".venv/bin/pip install -e .": "downloads the dependencies from PyPI (about 2 minutes)",
    ".ci/run": "is CI itself, which runs this test",
    "docker ": "needs a Docker daemon; .ci/image-check.sh builds and runs the image with podman",
    "kubectl ": "needs a cluster; tests/test_container.py checks k8s/ against Kubernetes' schemas",
    "python -m job.speculators train --verifier-name-or-path MODEL": "MODEL is the target, to fill in; "
    "tests/test_export.py trains from the line the export prints",
}


@dataclass(frozen=True)
class Command:
    line: int  # in README.md
    text: str  # as written, continuation lines joined
    shown: list[str]  # the output the README shows under it

    @property
    def steps(self) -> list[str]:
        return [step.strip() for step in self.text.split(" && ")]


def readme_commands(text: str) -> Iterator[Command]:
    """The commands of ``bash`` blocks, and the ``$ `` lines of other blocks with the output under
    each (up to a blank line)."""
    lines = text.splitlines()
    number = 0
    while number < len(lines):
        fence = lines[number]
        number += 1
        if not fence.startswith("```"):
            continue
        start = number
        while not lines[number].startswith("```"):
            number += 1
        block, number = lines[start:number], number + 1
        if fence == "```bash":
            yield from _bash_commands(block, start)
        elif fence == "```":
            yield from _prompted_commands(block, start)


def _bash_commands(block: list[str], start: int) -> Iterator[Command]:
    pending: list[str] = []
    for offset, line in enumerate(block):
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            yield Command(start + offset + 2 - len(pending), " ".join(pending), [])
            pending = []


def _prompted_commands(block: list[str], start: int) -> Iterator[Command]:
    for offset, line in enumerate(block):
        if line.startswith("$ "):
            shown = []
            for output in block[offset + 1 :]:
                if not output.strip() or output.startswith("$ "):
                    break
                shown.append(output)
            yield Command(start + offset + 1, line[2:], shown)


def elsewhere(step: str) -> str | None:
    return next((start for start in ELSEWHERE if step.startswith(start)), None)


def test_readme_commands_run_as_written(job_env: dict[str, str], tmp_path: Path) -> None:
    for shim in (tmp_path / "bin" / "python", tmp_path / ".venv" / "bin" / "python"):
        shim.parent.mkdir(parents=True)
        shim.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        shim.chmod(0o755)
    env = {**job_env, "PATH": f"{tmp_path / 'bin'}:{job_env['PATH']}"}
    commands = list(readme_commands(README.read_text(encoding="utf-8")))
    ran, skipped = [], set()
    for command in commands:
        for step in command.steps:
            if (start := elsewhere(step)) is not None:
                skipped.add(start)
                continue
            proc = subprocess.run(
                ["bash", "-c", step], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
            )
            where = f"README.md:{command.line}: {step}"
            assert proc.returncode == 0, f"{where}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
            if command.shown:
                assert proc.stdout.splitlines()[:1] == command.shown[:1], f"{where}: printed\n{proc.stdout}"
            ran.append(step)
    assert "python -m job inspect out" in ran  # the parsing found the shown commands
    assert skipped == set(ELSEWHERE), f"not in the README any more: {set(ELSEWHERE) - skipped}"


def test_readme_parsing() -> None:
    """Continuation lines are joined, comments and blank lines skipped, and a shown command keeps
    the output under it."""
    text = (
        "```bash\n# a comment\nfirst one \\\n  --flag=x\n\nsecond && third   # why\n```\n"
        "prose\n```\n$ shown\nout 1\nout 2\n\n$ bare\n```\n```python\nnot_a_command()\n```\n"
    )
    commands = list(readme_commands(text))
    assert [(c.line, c.text, c.shown) for c in commands] == [
        (3, "first one --flag=x", []),
        (6, "second && third   # why", []),
        (10, "shown", ["out 1", "out 2"]),
        (14, "bare", []),
    ]
    assert commands[1].steps == ["second", "third   # why"]
