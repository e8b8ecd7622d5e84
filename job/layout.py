"""Names of the output layout under ``output.uri`` (pinned with format_version 1).

::

    index-{i:05d}/shard-{k:05d}.safetensors   committed shards (many samples each)
    index-{i:05d}/shard-{k:05d}.regenerated.jsonl
                                              generate.mode: the conversations as regenerated,
                                              one line per sample of that shard
    index-{i:05d}/manifest.json               the commit record, rewritten after every shard
    index-{i:05d}/rejected.jsonl              one {"sample_id", "reason"} per rejected sample
    index-{i:05d}/logs/{run_id}.jsonl         each run's JSON event stream
    extraction.json                           what every index shares (settings, data, work.count),
                                              written once by the first run: one output, one extraction

A leaf module: every writer and reader of the layout, local or remote, takes the
names from here.
"""

from __future__ import annotations

MANIFEST = "manifest.json"
EXTRACTION = "extraction.json"
REJECTED = "rejected.jsonl"
LOGS = "logs"
SHARD_SUFFIX = ".safetensors"
REGENERATED_SUFFIX = ".regenerated.jsonl"
# A file being written under its final name plus this suffix (local stores, staging).
PARTIAL = ".partial"
# ``export --format speculators``: the export's own record, written last (job.export), and the
# speculators hidden-states backend that reads a reference export's rows from the shards
# (job.speculators).
SPECULATORS_EXPORT_RECORD = "eagle3_extract.json"
SPECULATORS_BACKEND = "eagle3-extract"


def index_dir_name(index: int) -> str:
    return f"index-{index:05d}"


def shard_name(number: int) -> str:
    return f"shard-{number:05d}{SHARD_SUFFIX}"


def regenerated_name(shard: str) -> str:
    """The sidecar of shard ``shard`` (it shares the shard's number)."""
    return shard.removesuffix(SHARD_SUFFIX) + REGENERATED_SUFFIX


def shard_number(name: str) -> int | None:
    """The number in ``shard-NNNNN.safetensors`` (also for temporary names), else None."""
    base = name.rsplit("/", 1)[-1]
    if not base.startswith("shard-"):
        return None
    digits = base[len("shard-") :].split(".", 1)[0]
    return int(digits) if digits.isdigit() else None


def log_name(run_id: str) -> str:
    return f"{LOGS}/{run_id}.jsonl"


def is_log(name: str) -> bool:
    return name.startswith(LOGS + "/")
