#!/usr/bin/env bash
# What a session with a GPU runs, in stages that fit one 10-minute device
# call each, or all of them in one (`all`, about 8 minutes on an H100).
# Results land in $OUT (default /tmp/gpu_session), as the device tool brings
# them back.
#
#   bash bench/gpu_session.sh build     # CUDA build (skipped when csrc/ is unchanged since)
#   bash bench/gpu_session.sh test      # the GPU tests
#   bash bench/gpu_session.sh bench     # kernels vs copy, host/kernel split, clawcomm bench --device cuda
#   bash bench/gpu_session.sh sanitize  # compute-sanitizer memcheck and racecheck: kernels and IPC
#   bash bench/gpu_session.sh latency   # where a small all-reduce's time goes (host, kernel, floor)
#   bash bench/gpu_session.sh kernels   # the kernels alone against the copy, top-k profiled
#   bash bench/gpu_session.sh train     # clawcomm train on CUDA: through CUDA IPC against staged
#   bash bench/gpu_session.sh all       # build, test, bench, sanitize, train
#
# pip install -e compiles csrc/cuda/ when torch is a CUDA build and nvcc is
# found; a fresh machine is bare, so every stage builds first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# The device tool copies the tree afresh each call (new mtimes), so the
# build is skipped by the sources' hash, not by their timestamps.
build() {
  local stamp=build/gpu_session.sources sum
  sum=$(find csrc setup.py -type f | sort | xargs sha1sum | sha1sum)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sum" ] &&
    python3 -c "from clawcomm import _C; assert _C.cuda_built" 2>/dev/null; then
    return 0
  fi
  # The system compiler, whose libstdc++ is the one torch loads: the image's
  # CXX=/opt/gcc/bin/g++ links a static libstdc++ that setup.py refuses.
  CC=gcc CXX=g++ MAX_JOBS=$(nproc) python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/build.log" 2>&1 ||
    { tail -40 "$OUT/build.log"; exit 1; }
  python3 -c "from clawcomm import _C; assert _C.cuda_built, 'no CUDA in this build'; print('cuda build ok')" &&
    mkdir -p build && echo "$sum" >"$stamp"
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

gpu_tests() {
  mps_on
  python3 -m pytest -q -p no:cacheprovider -n 6 tests/test_gpu_kernels.py tests/test_gpu.py \
    tests/test_split.py::test_torch_split_group_on_cuda \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -30
  mps_off
}

benchmarks() {
  mps_on
  python3 bench/gpu_kernels_bench.py --profile --json "$OUT/gpu_kernels.json" | tee "$OUT/gpu_kernels.txt"
  latency
  clawcomm bench --device cuda --nproc 2 --compare gloo -b 8 -e 64M -f 4 --quiet \
    --json "$OUT/cuda_2ranks.json" --plot "$OUT/cuda_2ranks.png" | tee "$OUT/cuda_2ranks.txt"
  clawcomm bench --device cuda --nproc 4 --compare gloo -b 32K -e 64M -f 4 --quiet \
    --json "$OUT/cuda_4ranks.json" | tee "$OUT/cuda_4ranks.txt"
  mps_off
}

latency() {
  python3 bench/gpu_latency.py --nproc 2 --json "$OUT/gpu_latency.json" | tee "$OUT/gpu_latency.txt"
}

# The trainer's step on CUDA through CUDA IPC against the same run staged
# through host memory (CLAWCOMM_CUDA_IPC=0): dp 2, and pp 2 (1f1b).
train_runs() {
  mps_on
  local args=(--device cuda --nproc 2 --steps 60 --dim 256 --layers 4 --seq-len 128 --quiet)
  for layout in "--dp 2" "--pp 2 --schedule 1f1b"; do
    for ipc in auto 0; do
      echo "# $layout, CLAWCOMM_CUDA_IPC=$ipc"
      # shellcheck disable=SC2086
      CLAWCOMM_CUDA_IPC=$ipc timeout 120 clawcomm train $layout "${args[@]}" 2>&1 | grep -E "final|median"
    done
  done | tee "$OUT/gpu_train.txt"
  mps_off
}

# The sanitizer does not run under MPS: two ranks on one GPU then take turns
# (a time slice per barrier), which is slow but checks the same accesses.
sanitize() {
  mps_off
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
      tests/test_gpu_kernels.py -k "1000 and not 100003" 2>&1 | tail -4 | tee -a "$OUT/sanitizer.log"
  done
  # The IPC kernels, in both ranks' processes: one-shot and two-shot
  # all-reduce, a graph replay, and sends and receives through the rings.
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --target-processes all --error-exitcode 9 \
      python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "(match_the_cpu_engine and 2-ipc and dtype0 and (1001- or 262144-)) or cuda_graph and 2 or arrive_whole and 67108864-2" \
      2>&1 | tail -4 | tee -a "$OUT/sanitizer.log"
  done
}

case "${1:-build}" in
  build) build ;;
  test) build && gpu_tests ;;
  bench) build && benchmarks ;;
  sanitize) build && sanitize ;;
  latency) build && mps_on && latency && mps_off ;;
  kernels) build && python3 bench/gpu_kernels_bench.py --profile --json "$OUT/gpu_kernels.json" | tee "$OUT/gpu_kernels.txt" ;;
  train) build && train_runs ;;
  all) build && gpu_tests && benchmarks && sanitize && train_runs ;;
  *)
    echo "usage: $0 build|test|bench|sanitize|latency|kernels|train|all" >&2
    exit 2
    ;;
esac
