"""One work index, end to end: ``runner.run_job`` and the pieces it wires together."""
