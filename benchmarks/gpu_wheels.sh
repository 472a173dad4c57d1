#!/usr/bin/env bash
# Downloads the wheels benchmarks/gpu_check.sh installs on a CUDA machine that cannot reach a registry.
#
#     benchmarks/gpu_wheels.sh DIR          (run where PyPI is reachable; then carry DIR to the GPU machine)
#
# That machine (../shared/notes/gpu.md) has Python 3.12, torch, triton, transformers, tokenizers, aiohttp,
# numpy and safetensors, but not what the gateway and the workers import besides: pydantic (and its three
# companions), redis, xgrammar (and the tvm-ffi runtime it loads), grpcio/protobuf recent enough for our
# generated stubs (grpcio >= 1.85.1, protobuf >= 7.35), pyzmq and msgpack (a worker's engine channel), orjson
# (the gateway's JSON), and
# OpenTelemetry's SDK and exporters (traces). gguf is left out: it is read only for GGUF models and
# the check serves a safetensors one.
#
# Versions are pinned to the ones the project's CPU environment runs with, so the GPU run tests the same
# stack; every wheel is fetched with --no-deps (the list is the whole closure beyond what the machine has)
# and must exist as a cp312 (or pure-Python) wheel for manylinux x86_64, or the script fails naming it.
set -euo pipefail
DIR=${1:?usage: benchmarks/gpu_wheels.sh DIR}
PY=${PYTHON:-python3}

WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  # pydantic-core needs a newer typing_extensions than torch may bring; a pure-Python wheel of a few dozen KB
  typing-extensions==4.16.0
  redis==8.1.0
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
  grpcio==1.85.3 protobuf==7.36.2
  # the local channel between a worker's front process and its engine process
  pyzmq==27.3.0 msgpack==1.2.4
  # the gateway's JSON bodies and large answers
  orjson==3.13.0
  # traces (services/tracing.py): the SDK, its OTLP exporters and what they bring
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
  googleapis-common-protos==1.76.0 requests==2.34.2 urllib3==2.8.0 idna==3.20 charset-normalizer==3.5.3
  certifi==2026.10.19.post1
)

mkdir -p "$DIR"
# Newer wheels are tagged manylinux_2_27/2_28 rather than manylinux2014; the GPU machine's glibc (Ubuntu
# 24.04, Python 3.12.3) takes all of these, so each is offered to pip.
PLATFORMS=(manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64)
args=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312 --abi abi3
      --abi none)
for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done

# One at a time, so that a wheel that does not resolve is named in the failure.
for spec in "${WHEELS[@]}"; do
  if ! "$PY" -m pip download --disable-pip-version-check -q "${args[@]}" -d "$DIR" "$spec"; then
    echo "gpu_wheels: no cp312 manylinux x86_64 wheel for $spec" >&2
    exit 1
  fi
done

ls -1 "$DIR"/*.whl
echo "gpu_wheels: $(find "$DIR" -name '*.whl' | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR" \
     "(the device tool carries at most 64 MiB with the tree)"
