#!/usr/bin/env bash
# The GPU checks of a lent machine, in one run of under 8 minutes (issue #56): tests/gpu, kvxferd bench gpu
# and the memory-model probe, each with its target and a verdict, then one summary line.
#
#   scripts/gpu-check.sh [python]      # default: .venv/bin/python (a CUDA build of torch and nixl installed)
#
# On a bare machine whose python3 has a CUDA torch (2026-11-30, an H200): carry the daemon's other packages
# as cp312 wheels (nixl, nixl-cu13 (its nixl_ep_cu13 folder dropped to fit), grpcio, grpcio-health-checking,
# grpcio-reflection, protobuf, pyzmq, pydantic, pydantic-core, pydantic-settings, annotated-types,
# typing-inspection, python-dotenv, cryptography, cffi, pycparser), `pip install --target` them, put that
# folder and the checkout on PYTHONPATH, then `scripts/gpu-check.sh python3`.
#
# UCX reports each path it chooses (UCX_PROTO_INFO) into a log file per process, which the probe reads
# back; the file's directory is printed. Exit 0 when every part passed, 1 otherwise, 2 without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
out=$(mktemp -d /tmp/kvxferd-gpu-check.XXXXXX)
verdicts=()

part() {  # part NAME SECONDS COMMAND...: run with a time limit, keep its output, record its verdict
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  local verdict=PASS; [ "$rc" -ne 0 ] && verdict="FAIL (exit $rc)"
  verdicts+=("$name: $verdict in $((SECONDS - start)) s")
  echo "-- $name: $verdict"
}

if ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: needs a CUDA GPU and a CUDA build of torch in $python" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /'
echo "RDMA devices: $(ls /sys/class/infiniband 2>/dev/null | tr "\n" " ")(end); nvidia-peermem: $([ -d /sys/module/nvidia_peermem ] && echo loaded || echo not loaded)"

part tests-gpu 190 "$python" -m pytest tests/gpu -q -rs -p no:cacheprovider
part bench-gpu 150 "$python" -m kvxferd bench gpu --quick
# Targets of issue #56 the bench prints against: same host >= 0.5x the device copy for 512 MiB,
# <= 500 us added per 4 MiB request; the transport self-check line names UCX's path.
UCX_PROTO_INFO=y UCX_LOG_FILE="$out/ucx.%p.log" part memory-model 120 "$python" -m kvxferd.rig.verify.memmodel

echo "== summary (logs in $out)"
printf '%s\n' "${verdicts[@]}"
for v in "${verdicts[@]}"; do case $v in *FAIL*) exit 1;; esac; done
exit 0
