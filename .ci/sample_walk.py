"""The driver-side walk of one sample through `python -m job run`, measured, not read off the code.

    python .ci/sample_walk.py SAMPLE_ID [python -m job run flags...]

runs the job in this process with a profile hook on every thread and records each call of a
function under job/ (job/worker/ excluded: that is vLLM's side) that receives the sample as an
argument: a string naming it (or naming its shard, once it has one), an object whose
``sample_id`` it is, a plan or shard holding it, or a list, dict or dataclass holding one of
those. Generator resumptions are not calls. Prints the files in the order the sample entered
them, with the functions, then the counts: distinct files, entries, the files it entered
again after leaving, and which of those it entered again through another module (not by one of
the file's own functions calling another after a call out returned), for the whole walk and for
the part up to the commit of the sample's shard. Use
``--data.tokenizer_workers=0`` (tokenizer processes are not traced).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import threading
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
JOB = str(REPO / "job") + "/"


class Walk:
    def __init__(self, sample_id: str) -> None:
        self.sample_id = sample_id
        self.names = {sample_id}  # the sample's id, then its shard's file name
        self.calls: list[tuple[str, str, str]] = []  # (file, function, the caller's file)
        self._first_offset: dict[CodeType, int] = {}

    def _holds(self, value: Any, depth: int = 0) -> bool:
        if isinstance(value, (str, bytes, bytearray, Path)):
            text = value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)
            return any(name in text for name in self.names)
        if getattr(value, "sample_id", None) == self.sample_id:
            return True
        plan = getattr(value, "plan", value)
        samples = getattr(plan, "samples", None)
        if isinstance(samples, list) and any(
            getattr(s, "sample_id", None) == self.sample_id for s in samples
        ):
            if isinstance(name := getattr(plan, "name", None), str):
                self.names.add(name)
            return True
        if (
            isinstance(name := getattr(getattr(value, "staged", value), "name", None), str)
            and name in self.names
        ):
            return True
        if depth:
            return False
        if isinstance(value, (list, tuple)):
            return any(self._holds(v, 1) for v in value[:64])
        if isinstance(value, dict):
            return any(self._holds(v, 1) for v in list(value.values())[:64])
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return any(self._holds(getattr(value, f.name, None), 1) for f in dataclasses.fields(value))
        return False

    def profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(JOB) or "/worker/" in code.co_filename:
            return
        # A generator's first call has its lowest offset; later "call" events are resumptions.
        if code.co_flags & inspect.CO_GENERATOR and frame.f_lasti != self._first_offset.setdefault(
            code, frame.f_lasti
        ):
            return
        arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        local = frame.f_locals
        try:
            if any(a != "self" and a in local and self._holds(local[a]) for a in arguments):
                caller = frame.f_back.f_code.co_filename if frame.f_back else ""
                self.calls.append((_relative(code.co_filename), code.co_name, _relative(caller)))
        except Exception:  # a value whose attributes cannot be read holds nothing we follow
            return

    def report(self) -> str:
        entries: list[tuple[str, list[str], str]] = []  # (file, functions, who called its first)
        for file, function, caller in self.calls:
            if not entries or entries[-1][0] != file:
                entries.append((file, [function], caller))
            elif function not in entries[-1][1]:
                entries[-1][1].append(function)
        lines = [f"{file:34s} {', '.join(functions)}" for file, functions, _ in entries]
        lines.append(f"whole walk: {_counts(entries)}")
        # Up to the shard's key, as the issue counts it ("from a JSONL line to its S3 key"): what
        # follows lists the durable shard in the manifest, rewritten after every later shard too.
        committed = next(
            (i for i, (_, functions, _) in enumerate(entries) if "commit_shard" in functions), None
        )
        if committed is not None:
            lines.append(f"to the shard's commit: {_counts(entries[: committed + 1])}")
        return "\n".join(lines)


def _counts(entries: list[tuple[str, list[str], str]]) -> str:
    """Distinct files, entries, the files entered again after leaving, and which of those were
    entered again through another module (a callback, a later stage), not by one of the file's
    own functions calling another after a call out returned."""
    order = [file for file, _, _ in entries]
    again = sorted({f for f in order if order.count(f) > 1})
    seen: set[str] = set()
    from_outside: set[str] = set()
    for file, _, caller in entries:
        if file in seen and caller != file:
            from_outside.add(file)
        seen.add(file)
    return (
        f"{len(set(order))} files, {len(order)} entries; entered again: {', '.join(again) or 'none'}; "
        f"of those, from another module: {', '.join(sorted(from_outside)) or 'none'}"
    )


def _relative(filename: str) -> str:
    return str(Path(filename).relative_to(REPO)) if filename.startswith(str(REPO)) else filename


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    walk = Walk(argv[0])
    sys.path.insert(0, str(REPO))
    from job.cli import main as job_main

    threading.setprofile(walk.profile)
    sys.setprofile(walk.profile)
    try:
        rc = job_main(["run", *argv[1:]])
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    print(walk.report())
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
