#!/usr/bin/env bash
# What a session with a GPU runs (issue 11's measurements), in stages that
# each fit one 10-minute device call. Results land in $OUT (default
# /tmp/gpu_session), at most 8 files, as the device tool brings them back.
#
#   bash bench/gpu_session.sh build     # CUDA build + the GPU tests (~4 min on an H100)
#   bash bench/gpu_session.sh bench     # kernels vs copy, clawcomm bench --device cuda at 2 and 4 ranks
#   bash bench/gpu_session.sh sanitize  # compute-sanitizer memcheck and racecheck on the kernel tests
#
# Every stage rebuilds if needed (a fresh machine is bare): pip install -e
# compiles csrc/cuda/ when torch is a CUDA build and nvcc is found.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

build() {
  # The system compiler, whose libstdc++ is the one torch loads: the image's
  # CXX=/opt/gcc/bin/g++ links a static libstdc++ that setup.py refuses.
  CC=gcc CXX=g++ MAX_JOBS=$(nproc) python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/build.log" 2>&1 ||
    { tail -40 "$OUT/build.log"; exit 1; }
  python3 -c "from clawcomm import _C; assert _C.cuda_built, 'no CUDA in this build'; print('cuda build ok')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
}

# Ranks that share one GPU need MPS: without it the GPU time-slices their
# contexts, and a CUDA IPC kernel spinning on a flag that a peer's kernel
# (waiting for its slice) will set costs a slice per barrier: ~4.5 ms per
# all-reduce at any size, measured on the H100. With MPS their kernels run
# side by side, as on one GPU per rank.
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS on"
}
mps_off() { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }

case "${1:-build}" in
  build)
    build
    mps_on
    # The trap test kills a kernel on purpose: alone and last, so that no
    # other test shares the MPS server when it does.
    python3 -m pytest -q -p no:cacheprovider -n 6 tests/test_gpu_kernels.py tests/test_gpu.py \
      -k "not never_arrives" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k never_arrives 2>&1 |
      tee -a "$OUT/gpu_tests.log" | tail -3
    mps_off
    ;;
  bench)
    build
    mps_on
    python3 bench/gpu_kernels_bench.py --json "$OUT/gpu_kernels.json" | tee "$OUT/gpu_kernels.txt"
    for n in 2 4; do
      clawcomm bench --device cuda --nproc $n --compare gloo,nccl -b 8 -e 256M -f 4 --quiet \
        --json "$OUT/cuda_${n}ranks.json" --plot "$OUT/cuda_${n}ranks.png" | tee "$OUT/cuda_${n}ranks.txt"
    done
    mps_off
    ;;
  sanitize)
    build
    mps_off # the sanitizer runs were taken with MPS off
    for tool in memcheck racecheck; do
      compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
        tests/test_gpu_kernels.py -k "1000 and not 100003" 2>&1 | tail -15 | tee -a "$OUT/sanitizer.log"
    done
    ;;
  *)
    echo "usage: $0 build|bench|sanitize" >&2
    exit 2
    ;;
esac
