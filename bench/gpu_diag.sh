#!/usr/bin/env bash
# Diagnose the trainer on CUDA: each run's whole output, Python stacks of a
# run that hangs (faulthandler on SIGABRT), then the GPU trainer tests by name.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
bash bench/gpu_session.sh build || exit 1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p /tmp/mps /tmp/mps-log && nvidia-cuda-mps-control -d
args=(--device cuda --nproc 2 --steps 6 --dim 256 --layers 4 --seq-len 128)
one() {
  local name=$1 cap=$2
  shift 2
  ("$@" >"$OUT/$name.log" 2>&1) &
  local pid=$! i
  for ((i = 0; i < cap; i++)); do
    sleep 1
    kill -0 $pid 2>/dev/null || break
  done
  if kill -0 $pid 2>/dev/null; then
    echo "## $name HUNG after ${cap}s"
    # The ranks are forked: they carry the launcher's command line.
    pkill -ABRT -f "clawcomm train"
    sleep 3
    pkill -KILL -f "clawcomm train"
    kill -KILL $pid 2>/dev/null
  else
    echo "## $name ended"
  fi
  tail -25 "$OUT/$name.log"
}
one dp_auto 35 clawcomm train --dp 2 "${args[@]}"
one pp_auto 35 clawcomm train --pp 2 --schedule 1f1b "${args[@]}"
CLAWCOMM_CUDA_P2P_BYTES=0 one pp_p2p0 35 clawcomm train --pp 2 --schedule 1f1b "${args[@]}"
CLAWCOMM_CUDA_P2P_BYTES=0 one dp_p2p0 35 clawcomm train --dp 2 "${args[@]}"
timeout 100 python3 -m pytest -v -p no:cacheprovider -n 6 tests/test_gpu.py \
  -k "trainer_on_cuda or arrive_whole or posted_before" 2>&1 | grep -E "PASSED|FAILED|ERROR|Error|assert" >"$OUT/tests.log"
cat "$OUT/tests.log"
