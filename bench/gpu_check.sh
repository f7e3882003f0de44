#!/usr/bin/env bash
# The GPU check: what a session with a one-GPU machine runs, unattended, on a
# fresh machine (16 cores, the repository copied as a working tree, no .venv,
# no .git) in at most 8 minutes. Each phase starts only if the time it needs
# is left (GPU_CHECK_BUDGET_S, default 480), and runs under a timeout that
# keeps the budget:
#
#   build      the CUDA build (pip install -e .; the system g++, see below)
#   latency    bench/gpu_latency.py on the fresh machine, with the host's state
#   zero3      clawcomm train --device cuda --zero 3 (2 ranks, 6 steps, a small
#              GPT; --max-memory-mb, which counts the CUDA IPC buffers)
#   tests      the GPU tests: tests/test_gpu_work.py first, then the rest
#              (tests/test_gpu*.py, torch's split_group on CUDA) while time lasts
#   latency2   bench/gpu_latency.py again, after the tests, with the host's
#              state: a fresh machine measured 16.9 us at 256 KiB and one after
#              the tests 32.6 us (docs/gpu.md); the two host states say why
#   bench      clawcomm bench --device cuda --nproc 2 --compare gloo, if the
#              sanitizer still fits after it
#   memcheck   compute-sanitizer memcheck on the CUDA IPC tests, both ranks'
#              processes (not under MPS, which the sanitizer does not support)
#
# Beyond it, while time is left (a warm machine, where the build is skipped, or
# a larger GPU_CHECK_BUDGET_S): kernels (bench/gpu_kernels_bench.py),
# racecheck on the IPC tests, and train (the trainer through CUDA IPC against
# staged). A run that hangs is stopped with SIGABRT first, so every rank
# prints its Python stacks into the phase's output.
#
# Both ranks share the one GPU, under MPS (without it each barrier inside an
# IPC kernel waits a time slice: ~4.5 ms per all-reduce). A layout with rank
# r on cuda:r needs a GPU per rank: this machine cannot run it.
#
# Everything lands in $OUT (default /tmp/gpu_check): each phase's output
# (<phase>.txt, JSON where the benchmark writes one, each JSON with its
# provenance: date, commit, tree hash, GPU), host_state.txt (load, CPU and GPU
# clocks, temperatures, processes, before and after the tests), and
# check.txt: date, commit, machine, then one line per phase (verdict,
# seconds, why skipped).
#
#   CLAWCOMM_COMMIT=$(git rev-parse HEAD) bash bench/gpu_check.sh   # the machine has no .git
#   bash bench/gpu_check.sh --dry-run    # the plan and the gates; runs nothing, needs no GPU
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-/tmp/gpu_check}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
START=$(date +%s)
SUMMARY=$OUT/check.txt

# A dry run moves a clock of its own by each phase's usual seconds (TYPICAL),
# so that its gates show what a run on a fresh H100 would do.
SIM=0
elapsed() { echo $(($(date +%s) - START + SIM)); }
typical() {
  case $1 in
    build) echo 200 ;; tests) echo $(($2 < 200 ? $2 : 200)) ;; bench | kernels) echo 40 ;;
    memcheck | racecheck) echo 45 ;;
    train) echo 90 ;; *) echo 25 ;;
  esac
}
left() { echo $((BUDGET - $(elapsed))); }
note() { echo "$*" | tee -a "$SUMMARY"; }

COMMIT=$(git rev-parse HEAD 2>/dev/null || echo "${CLAWCOMM_COMMIT:-not recorded}")
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
  head -1)
: >"$SUMMARY"
note "# bash bench/gpu_check.sh$([ $DRY = 1 ] && echo ' --dry-run'), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
note "# commit ${COMMIT}; tree $($PY clawcomm/bench/provenance.py --tree 2>/dev/null || echo 'not recorded')"
note "# machine: ${GPU:-no GPU (nvidia-smi found none)}; $(grep -m1 'model name' /proc/cpuinfo |
  cut -d: -f2 | sed 's/^ //') x $(nproc); budget ${BUDGET} s"
note "# phase      verdict                        seconds"

# The host's state, appended to host_state.txt under a heading.
host_state() {
  {
    echo "## $1, $(date -u +%H:%M:%SZ)"
    echo "load: $(cut -d' ' -f1-3 /proc/loadavg); up $(cut -d' ' -f1 /proc/uptime) s"
    awk -F: '/MHz/ {m = $2 + 0; s += m; n++; if (m > x) x = m; if (!l || m < l) l = m}
      END {if (n) printf "cpu MHz: min %.0f, mean %.0f, max %.0f over %d cores\n", l, s / n, x, n}' \
      /proc/cpuinfo
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --format=csv --query-gpu=pstate,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw,utilization.gpu,memory.used
      nvidia-smi --format=csv --query-gpu=clocks_event_reasons.active ||
        nvidia-smi --format=csv --query-gpu=clocks_throttle_reasons.active
      echo "compute apps: $(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | tr '\n' ';')"
    else
      echo "nvidia-smi: not found"
    fi
    echo "MPS daemon: $(pgrep -f nvidia-cuda-mps-control >/dev/null && echo running || echo off)"
    echo "busiest processes:"
    ps -eo pid,pcpu,etime,comm --sort=-pcpu | head -6
  } >>"$OUT/host_state.txt" 2>&1
}

# phase NAME NEEDS_S CAP_S FUNCTION [ARGS]: runs the function in a shell of
# its own (under `timeout`, which stops its whole process group: ranks
# included) if NEEDS_S seconds are left, for at most CAP_S (and at most what
# is left); its output in $OUT/NAME.txt.
phase() {
  local name=$1 needs=$2 cap=$3
  shift 3
  local l
  l=$(left)
  [ "$cap" -gt "$l" ] && cap=$l
  if [ "$cap" -lt "$needs" ]; then
    note "$(printf '%-10s %-30s %7s' "$name" "skipped: ${cap} s for it, needs ${needs}" 0)"
    return 1
  fi
  if [ $DRY = 1 ]; then
    local t
    t=$(typical "$name" "$cap")
    SIM=$((SIM + t))
    note "$(printf '%-10s %-30s %7s' "$name" "would run (cap ${cap} s)" "~$t")  $*"
    return 0
  fi
  local t0=$SECONDS rc verdict=ok
  # SIGABRT first: with PYTHONFAULTHANDLER set, every process of a run that
  # hangs prints its Python stacks before it goes.
  timeout --signal=ABRT --kill-after=10 "$cap" bash -c "$*" >"$OUT/$name.txt" 2>&1
  rc=$?
  if [ $rc = 124 ] || [ $rc = 137 ]; then
    verdict="cut at ${cap} s"
  elif [ $rc != 0 ]; then
    verdict="failed (rc $rc)"
  fi
  note "$(printf '%-10s %-30s %7s' "$name" "$verdict" $((SECONDS - t0)))"
  tail -3 "$OUT/$name.txt"
  return $rc
}

# The phases' bodies, exported to phase()'s shells.

# The system compiler, whose libstdc++ is the one torch loads (the image's
# CXX=/opt/gcc/bin/g++ links a static libstdc++ that setup.py refuses).
# Nothing to do where this tree is already built with CUDA (a warm machine).
build() {
  if $PY -c "from clawcomm import _C; assert _C.cuda_built" 2>/dev/null; then
    echo "already built with CUDA"
    return 0
  fi
  CC=gcc CXX=g++ MAX_JOBS=$(nproc) $PY -m pip install -q --no-deps --no-build-isolation -e . &&
    $PY -c "from clawcomm import _C; assert _C.cuda_built, 'no CUDA in this build'; print('cuda build ok')"
}

latency() { $PY bench/gpu_latency.py --nproc 2 --json "$OUT/$1.json"; }

# ZeRO-3 on CUDA through the command line (the tests also compare it, and
# with fp16 compression and no overlap, with the CPU run's losses).
zero3() {
  local args=(--device cuda --nproc 2 --dp 2 --zero 3 --model gpt --dim 128 --layers 2
    --seq-len 64 --steps 6 --quiet --max-memory-mb 100000)
  echo "# clawcomm train ${args[*]}"
  $PY -m clawcomm.cli train "${args[@]}"
}

# The new checks first (the device path's Work, ZeRO-3 against the CPU run),
# so that a cut leaves them run; then the rest.
NEW="gpu_work or trainer_on_cuda and (layout8 or layout9)"
gpu_tests() {
  $PY -m pytest -q -p no:cacheprovider -rfE $XDIST tests/test_gpu_work.py tests/test_gpu.py \
    -k "$NEW" || echo "# (the checks above failed)"
  $PY -m pytest -q -p no:cacheprovider -rfE $XDIST tests/test_gpu_kernels.py tests/test_gpu.py \
    tests/test_split.py::test_torch_split_group_on_cuda -k "not ($NEW)"
}

bench() {
  $PY -m clawcomm.cli bench --device cuda --nproc 2 --compare gloo -b 8 -e 64M -f 4 --quiet \
    --json "$OUT/cuda_2ranks.json" --plot "$OUT/cuda_2ranks.png"
}

# The IPC kernels in both ranks' processes: one-shot and two-shot all-reduce,
# a graph replay, sends and receives through the rings, and the ordering of
# a synchronous call after an asynchronous one.
memcheck() {
  compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
    $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_work.py \
    -k "(match_the_cpu_engine and 2-ipc and dtype0 and (1001- or 262144-)) or cuda_graph and 2 or arrive_whole and 67108864-2 or synchronous_call_waits"
}

kernels() { $PY bench/gpu_kernels_bench.py --profile --json "$OUT/gpu_kernels.json"; }

racecheck() {
  compute-sanitizer --tool racecheck --target-processes all --error-exitcode 9 \
    $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "match_the_cpu_engine and 2-ipc and dtype0 and 1001-"
}

# The trainer's step through CUDA IPC against the same run staged through
# host memory (CLAWCOMM_CUDA_IPC=0): dp 2, and pp 2 (1f1b, through the rings).
train_ipc_vs_staged() {
  local args=(--device cuda --nproc 2 --steps 30 --dim 256 --layers 4 --seq-len 128 --quiet)
  for layout in "--dp 2" "--pp 2 --schedule 1f1b"; do
    for ipc in 1 0; do
      echo "# $layout, CLAWCOMM_CUDA_IPC=$ipc"
      # shellcheck disable=SC2086
      CLAWCOMM_CUDA_IPC=$ipc $PY -m clawcomm.cli train $layout "${args[@]}" 2>&1 | grep -E "final|median|rror"
    done
  done
}

mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  [ $DRY = 1 ] || nvidia-cuda-mps-control -d 2>/dev/null || true
}
mps_off() { [ $DRY = 1 ] || { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }; }

XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n 8"
export PY OUT NEW XDIST CLAWCOMM_COMMIT=$COMMIT
export -f build latency zero3 gpu_tests bench memcheck kernels racecheck train_ipc_vs_staged

# Seconds: what each phase needs to start and may take at most. On an H100
# (2026-11) the GPU tests took 190 s with -n 6, the latency run 20 s, the
# sanitizer's IPC tests 40 s; a warm machine skips the build. What does not
# fit is skipped, and check.txt says so.
phase build 120 300 build || { [ $DRY = 1 ] || { note "# no CUDA build: nothing else runs"; exit 1; }; }
mps_on
host_state "fresh machine, before the first latency run"
phase latency 30 60 latency gpu_latency_fresh
phase zero3 30 75 zero3
# The tests get what is left once the second latency run and the sanitizer
# are provided for (100 s); the benchmark runs only if the sanitizer still fits.
phase tests 60 $(($(left) - 100)) gpu_tests
host_state "after the tests, before the second latency run"
phase latency2 30 60 latency gpu_latency_after_tests
phase bench 40 $(($(left) - 60)) bench
mps_off
phase memcheck 45 120 memcheck
# Beyond the check, while time is left (a warm machine, or a larger
# GPU_CHECK_BUDGET_S): the kernels against the copy, racecheck, and the
# trainer through CUDA IPC against staged.
phase kernels 40 60 kernels
phase racecheck 60 120 racecheck
mps_on
phase train 90 150 train_ipc_vs_staged
mps_off
host_state "at the end"
[ $DRY = 1 ] || $PY clawcomm/bench/provenance.py >"$OUT/provenance.json" 2>/dev/null
note "# done after $(elapsed) s; outputs in $OUT"
