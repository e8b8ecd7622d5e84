"""Benchmarks: scripts that print figures (and write them to docs/), never used by a run.

``throughput`` (``python -m job.benchmarks.throughput``, alias ``python -m job bench``) extraction
next to plain vLLM prefill and the write path's ceiling; ``s3_ceiling`` an S3 endpoint's raw
upload ceiling with boto3 alone; ``record_memory`` the peak memory of reading and tokenizing one
large record; ``masking`` the samples per CPU second of tokenizing and masking agentic
conversations; ``preflight_time`` how long ``python -m job preflight`` takes against the start-up
it saves; ``dataset_read`` reading an output back with ``OutputDataset`` (local, S3, memory,
follow latency); ``regeneration`` a regenerating run against its parts (generation alone,
extraction alone) on one engine; ``speculators_export`` the bytes a reference export saves and
speculators' loader reading it; ``real_activations`` the backends against HF float32 and FP8
storage on a real model's activations (SmolLM2-135M-Instruct's own answers: crest factors, outlier
channels, scale schemes); ``acceptance`` EAGLE-3 drafts trained with speculators on the job's
output of a real model (builtin:smollm2-135m-instruct), served by vLLM: acceptance, the serving
contract, controls. They import the job's modules; nothing in the job imports them (``python -m
job bench`` replaces its process with the throughput benchmark's own).
"""
