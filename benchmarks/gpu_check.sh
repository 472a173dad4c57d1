#!/usr/bin/env bash
# One GPU check (issue 27): kernel tests, runtime figures and serving figures on one CUDA machine, each
# target of the issue printed beside its figure.
#
#     benchmarks/gpu_wheels.sh wheels              # where PyPI is reachable: the packages the GPU machine lacks
#     benchmarks/gpu_check.sh [WHEELS_DIR]         # on the GPU machine, from the checkout; about seven minutes
#
# Made for a bare CUDA machine with torch, triton and transformers but no network and no registry
# (../shared/notes/gpu.md): what else pdserve imports comes from WHEELS_DIR, installed into a scratch folder
# with --no-index --no-deps; the package is laid out from the checkout without installing (the mapping
# pyproject.toml makes), and the model is random weights of SmolLM2-135M's shape beside its real tokenizer
# (benchmarks/gpu_model_files), since no model can be downloaded there.
#
# Runs, in order: (a) the CUDA kernel tests and the decode-graph tests; (b) benchmarks/gpu_runtime.py (step
# times with graphs on and off, GPU-busy fraction, kernels per step, greedy parity, transformers with a static
# cache + torch.compile timed in the same run); (b2) on two GPUs or more, benchmarks/gpu_tp.py (greedy TP 1 vs
# TP 2, decode step times at batch 1 and 64); (b3) benchmarks/gpu_tiers.py (the host-memory KV tier: greedy tokens
# with a prefix copied back from host memory, and the copies' GB/s into and out of pinned memory); (c) `pdserve bench` against a colocated worker, then against
# prefill + decode on the same GPU with TCP transfer, at 1, 64 and 256 streams of 128 tokens after ~200-token
# prompts (workers and gateway started directly: there is no redis-server there), the colocated worker also
# alone (benchmarks/bench_worker_streams.py: gRPC streams straight to it); then the targets table.
# Everything lands in $OUT (the device tool brings that folder back) or in a scratch folder it names.
#
# GPU_CHECK_DEVICE=cpu runs the script itself on a CPU (tiny model, tiny loads, no kernel tests): a smoke
# test of its plumbing, not a measurement. Exit status: 0 when every step ran (targets may still be missed).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${1:-}
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
if [ "$DEVICE" = cpu ]; then
  # Small enough for a shared 2-core machine; one compute thread per worker so the processes do not thrash.
  LEVELS=(1 4) OUTPUT_LEN=8 PROMPT_LEN=40 RUNTIME_ARGS=(--device cpu --dry-run) MODEL_ARGS=(--dry-run)
  GATEWAY_WORKERS=${GPU_CHECK_GATEWAY_WORKERS:-2}
  export OMP_NUM_THREADS=1
else
  LEVELS=(1 64 256) OUTPUT_LEN=128 PROMPT_LEN=200 RUNTIME_ARGS=() MODEL_ARGS=()
  # One gateway process writes, and one bench process reads, ~10-20k SSE events per second at most: at the
  # targets' rates either would be the bottleneck, not the GPU; as many client processes as gateway processes.
  GATEWAY_WORKERS=${GPU_CHECK_GATEWAY_WORKERS:-4}
fi

# The device first: nothing else is worth doing without one (torch is the machine's own).
"$PY" - "$DEVICE" <<'EOF' || exit 2
import sys
import torch
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_check: torch.cuda.is_available() is false on this machine: run it on a CUDA GPU "
             "(GPU_CHECK_DEVICE=cpu checks the script's plumbing only)")
EOF

# Scratch (wheels, package layout, a 269 MB model) goes when the script ends; results stay.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
RESULTS=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_results.XXXXXX")}
LOGS=$RESULTS/logs
mkdir -p "$LOGS"
STARTED=$SECONDS
PIDS=()  # services this script started
FAILED=()  # steps that did not finish cleanly, for the exit status and the report

log() { echo "[gpu_check +$((SECONDS - STARTED))s] $*" >&2; }
failed() { FAILED+=("$1"); log "step failed: $1"; }
start() {  # NAME pdserve-ARGS...: a service in the background, its output in logs/NAME.log
  local name=$1; shift
  "$PY" -m pdserve "$@" >"$LOGS/$name.log" 2>&1 &
  PIDS+=($!)
  log "started $name (pid $!)"
}

stop_all() {  # SIGTERM to what this script started, then SIGKILL to what is left after 30 s
  [ ${#PIDS[@]} -gt 0 ] || return 0
  kill "${PIDS[@]}" 2>/dev/null
  for _ in $(seq 60); do
    kill -0 "${PIDS[@]}" 2>/dev/null || break
    sleep 0.5
  done
  kill -9 "${PIDS[@]}" 2>/dev/null
  wait "${PIDS[@]}" 2>/dev/null
  PIDS=()
}

cleanup() { stop_all; rm -rf "$WORK"; }
trap cleanup EXIT

# ---------------------------------------------------------------- environment
# Wheels go into a scratch folder ahead of the system's packages; --no-deps because the wheel list is already
# the whole closure beyond what the machine has (benchmarks/gpu_wheels.sh).
SITE=$WORK/site
if [ -n "$WHEELS" ]; then
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
  [ ${#wheels[@]} -gt 0 ] || { log "no wheels in $WHEELS"; exit 2; }
  log "installing ${#wheels[@]} wheels from $WHEELS into $SITE"
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$SITE" "${wheels[@]}" \
    || { log "pip could not install the wheels"; exit 2; }
fi

# The package without installing it: pdserve/ holds the entry points; shared/, kernels/, proto/ and services/
# become its subpackages, as pyproject.toml's package-dir maps them.
PKG=$WORK/pd/pdserve
mkdir -p "$PKG"
cp "$REPO"/pdserve/*.py "$PKG"/
for sub in shared kernels proto services; do cp -r "$REPO/$sub" "$PKG/$sub"; done
export PYTHONPATH=$WORK/pd${WHEELS:+:$SITE}
# No native CPU kernel build: the GPU runs Triton, and the CPU fall-back ops need no compiler.
export PDSERVE_NATIVE_KERNELS=0
# Nothing can be downloaded there: fail at once instead of waiting on the hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# Run from the scratch folder, so `pdserve` resolves to the layout above and not to the checkout's pdserve/.
cd "$WORK" || exit 2
"$PY" - <<'EOF' || { log "the layout does not import: are the wheels from benchmarks/gpu_wheels.sh given?"; exit 2; }
import sys
import torch
import grpc, google.protobuf, pydantic  # what the wheels bring, imported before any step needs them
import pdserve.services.gateway.app, pdserve.shared.engine  # noqa: F401
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
print(f"[gpu_check] {name}; torch {torch.__version__}, grpcio {grpc.__version__}, "
      f"protobuf {google.protobuf.__version__}, pydantic {pydantic.VERSION}", file=sys.stderr)
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$RESULTS/gpu.txt" 2>/dev/null || true

MODEL=$WORK/model
log "building the random-weight model in $MODEL"
"$PY" "$REPO/benchmarks/gpu_runtime.py" --save-model "$MODEL" "${MODEL_ARGS[@]}" >"$LOGS/model.log" 2>&1 \
  || { tail -20 "$LOGS/model.log"; log "could not build the model"; exit 2; }

# ---------------------------------------------------------------- (a) tests
# --rootdir/-c keep the project's pytest settings while running from outside the checkout.
pytest_run() {  # NAME ARGS...
  local name=$1; shift
  log "tests: $name"
  if ! timeout 240 "$PY" -m pytest --rootdir "$REPO" -c "$REPO/pyproject.toml" -p no:cacheprovider -q -rfE \
      --tb=short "$@" >"$LOGS/tests_$name.log" 2>&1; then
    failed "tests_$name"
    grep -E "^(FAILED|ERROR) " "$LOGS/tests_$name.log" >&2  # which ones; the log has their tracebacks
  fi
  grep -E "[0-9]+ (passed|failed)" "$LOGS/tests_$name.log" | tail -1 >&2
}
# GPU_CHECK_SERVING_ONLY=1 skips (a) and (b): the serving figures alone, in about a minute and a half.
SERVING_ONLY=${GPU_CHECK_SERVING_ONLY:-0}
if [ "$DEVICE" = cuda ] && [ "$SERVING_ONLY" = 0 ]; then
  pytest_run kernels "$REPO/tests/kernels" -k "cuda or triton"
  pytest_run overlap "$REPO/tests/shared/test_overlap.py" -k cuda  # no wait for the device in a decode step
  pytest_run transfer "$REPO/tests/shared/transfer/test_transfer_backends.py" -k cuda  # CUDA IPC and staged TCP
fi
if [ "$SERVING_ONLY" = 0 ]; then
  pytest_run decode_graphs "$REPO/tests/shared/test_decode_graphs.py"

  # -------------------------------------------------------------- (b) the runtime
  log "gpu_runtime.py"
  timeout 300 "$PY" "$REPO/benchmarks/gpu_runtime.py" --model-path "$MODEL" --json "$RESULTS/runtime.json" \
    "${RUNTIME_ARGS[@]}" 2>&1 | tee "$LOGS/runtime.log" | grep -v "Loading weights\|Writing model" >&2
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed runtime
fi

# ---------------------------------------------------------------- (b2) tensor parallelism, where there are GPUs for it
# Greedy fp32 identical TP 1 vs TP 2 and decode step times at batch 1 and 64 (benchmarks/gpu_tp.py); on a CPU dry
# run, the same script on the tiny model over two cores.
GPUS=0
[ "$DEVICE" = cuda ] && GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$SERVING_ONLY" = 0 ] && { [ "$GPUS" -ge 2 ] || [ "$DEVICE" = cpu ]; }; then
  log "gpu_tp.py (tensor parallelism over 2 ranks)"
  timeout 240 "$PY" "$REPO/benchmarks/gpu_tp.py" --model-path "$MODEL" --device "$DEVICE" --tp-size 2 --rounds 2 \
    --json "$RESULTS/tp.json" ${RUNTIME_ARGS[@]:+--dry-run} 2>&1 | tee "$LOGS/tp.log" | grep -v " INFO " >&2
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed tensor_parallel
elif [ "$SERVING_ONLY" = 0 ]; then
  log "tensor parallelism skipped: $GPUS GPU(s) here, it needs 2"
fi

# ---------------------------------------------------------------- (b3) the host-memory KV tier
if [ "$SERVING_ONLY" = 0 ]; then
  log "gpu_tiers.py (host-memory KV tier)"
  timeout 180 "$PY" "$REPO/benchmarks/gpu_tiers.py" --model-path "$MODEL" --device "$DEVICE" \
    --json "$RESULTS/tiers.json" ${RUNTIME_ARGS[@]:+--dry-run} 2>&1 | tee "$LOGS/tiers.log" | grep -v " INFO " >&2
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed host_tier
fi

# ---------------------------------------------------------------- (c) serving
# Fixed loopback ports below the kernel's ephemeral range; HTTP ports are gRPC + 1000, TCP KV ports + 2000.
GATEWAY_PORT=30000 COLOCATED_PORT=21051 PREFILL_PORT=21061 DECODE_PORT=21071
WORKER_ARGS=(--model-path "$MODEL" --device "$DEVICE" --dtype bfloat16 --host 127.0.0.1)
if [ "$DEVICE" = cuda ]; then
  # Two workers share the GPU in the PD run: each takes 30 % of the memory free after its weights.
  WORKER_ARGS+=(--mem-fraction 0.3)
else
  WORKER_ARGS+=(--max-total-tokens 16384)
fi
wait_ready() {  # until the gateway generates a token (the workers compile their kernels first), at most 180 s
  local deadline=$((SECONDS + 180)) pid
  until "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$GATEWAY_PORT/health_generate', timeout=30)" \
      2>/dev/null; do
    for pid in "${PIDS[@]}"; do
      if ! kill -0 "$pid" 2>/dev/null; then log "a service exited while starting (pid $pid)"; return 1; fi
    done
    if [ $SECONDS -ge $deadline ]; then log "not ready after 180 s"; return 1; fi
    sleep 1
  done
  log "serving"
}

bench() {  # DEPLOYMENT: one `pdserve bench` per level, two waves of requests each (at least 8)
  local c n
  for c in "${LEVELS[@]}"; do
    n=$((c * 2 > 8 ? c * 2 : 8))
    timeout 240 "$PY" -m pdserve bench --base-url "http://127.0.0.1:$GATEWAY_PORT/v1" --concurrency "$c" \
      --client-processes "$GATEWAY_WORKERS" \
      --num-requests "$n" --output-len "$OUTPUT_LEN" --prompt-len "$PROMPT_LEN" --timeout 120 --no-progress \
      --json "$RESULTS/bench_$1_$c.json" >"$LOGS/bench_$1_$c.log" 2>&1 || failed "bench_$1_$c"
    grep -A1 "^conc " "$LOGS/bench_$1_$c.log" >&2  # the table's header and its row
  done
}

serve_logs_on_failure() {  # NAMES...: the last lines of each service's log, where something went wrong
  local name
  for name in "$@"; do echo "--- $name" >&2; tail -15 "$LOGS/$name.log" >&2; done
}

log "serving: colocated"
start colocated colocated "${WORKER_ARGS[@]}" --port $COLOCATED_PORT --max-running-requests 256
start gateway_colocated gateway --model-path "$MODEL" --host 127.0.0.1 --port $GATEWAY_PORT \
  --gateway-workers "$GATEWAY_WORKERS" --worker 127.0.0.1:$COLOCATED_PORT
if wait_ready; then
  # The worker alone first (gRPC streams straight to it, no gateway): with the gateway's figures below, this
  # splits what serving costs between the two.
  log "the colocated worker alone"
  timeout 240 "$PY" "$REPO/benchmarks/bench_worker_streams.py" --addr 127.0.0.1:$COLOCATED_PORT \
    --streams "$(IFS=,; echo "${LEVELS[*]}")" --tokens $((OUTPUT_LEN * 2)) --json "$RESULTS/worker_alone.json" \
    2>&1 | tee "$LOGS/worker_alone.log" >&2
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed worker_alone
  bench colocated
else
  failed serve_colocated; serve_logs_on_failure colocated gateway_colocated
fi
stop_all

log "serving: prefill + decode on one device, TCP transfer"
start prefill prefill "${WORKER_ARGS[@]}" --port $PREFILL_PORT --transfer-backend tcp
start decode decode "${WORKER_ARGS[@]}" --port $DECODE_PORT --prefill 127.0.0.1:$PREFILL_PORT \
  --transfer-backend tcp --max-running-requests 256
start gateway_pd gateway --model-path "$MODEL" --host 127.0.0.1 --port $GATEWAY_PORT \
  --gateway-workers "$GATEWAY_WORKERS" --prefill 127.0.0.1:$PREFILL_PORT --decode 127.0.0.1:$DECODE_PORT
if wait_ready; then
  bench pd
  # The prefill worker's KV transfer counters (bytes, seconds) for the GB/s of the PD row.
  "$PY" -c "import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1]).read().decode())" \
    "http://127.0.0.1:$((PREFILL_PORT + 1000))/metrics" >"$RESULTS/prefill_metrics.txt" 2>/dev/null || true
else
  failed serve_pd; serve_logs_on_failure prefill decode gateway_pd
fi
stop_all

# ---------------------------------------------------------------- the targets
report=(--runtime "$RESULTS/runtime.json" --json "$RESULTS/gpu_check.json" --elapsed $((SECONDS - STARTED)))
for f in "$RESULTS"/bench_colocated_*.json; do [ -e "$f" ] && report+=(--colocated "$f"); done
for f in "$RESULTS"/bench_pd_*.json; do [ -e "$f" ] && report+=(--pd "$f"); done
[ -s "$RESULTS/prefill_metrics.txt" ] && report+=(--kv-metrics "$RESULTS/prefill_metrics.txt")
[ -s "$RESULTS/worker_alone.json" ] && report+=(--worker-alone "$RESULTS/worker_alone.json")
[ -s "$RESULTS/tp.json" ] && report+=(--tp "$RESULTS/tp.json")
[ -s "$RESULTS/tiers.json" ] && report+=(--tiers "$RESULTS/tiers.json")
[ -s "$RESULTS/gpu.txt" ] && report+=(--gpu "$(head -1 "$RESULTS/gpu.txt")")
for step in "${FAILED[@]}"; do report+=(--failed "$step"); done
"$PY" "$REPO/benchmarks/gpu_report.py" "${report[@]}" | tee "$RESULTS/targets.txt" || failed report
log "done in $((SECONDS - STARTED)) s; results in $RESULTS${FAILED[*]:+; failed: ${FAILED[*]}}"
[ ${#FAILED[@]} -eq 0 ]
