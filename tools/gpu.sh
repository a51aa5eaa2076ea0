#!/usr/bin/env bash
# Everything a CUDA change needs before it is done, in one run on a GPU machine:
# build, the test suite, compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over
# every kernel path of every op (tools/sanitize_run.py forces each path of each table),
# kernel-vs-call timing, and the benchmark; optionally a timing comparison with another build.
#
#   OUT=/some/dir bash tools/gpu.sh         # logs + results land in $OUT
#   TEST_FILES="test_flow_euler.py" BENCH_ARGS="--ops flow" ...   # a narrower run
#   SANITIZE_GROUPS="flow vae_elbo" SANITIZE_TOOLS="memcheck racecheck" SKIP_BENCH=1 ...
#                        (ops of tools/sanitize_run.py; "flow"/"vae": forward and backward)
#   BENCH_MODES="forward train"   benchmark modes (default: forward): $OUT/<device>.* and
#                        $OUT/<device>-train.*, the files bench/results/ keeps
#   FUSED_OPS_WHEEL=dist/x.whl OUT=... bash tools/gpu.sh
#       installs that wheel (built elsewhere, e.g. on the CI machine) instead of
#       building, and runs everything against the installed package from a
#       directory outside the source tree: the "one wheel" check of the stable ABI.
#   SKIP_BUILD=1         use the extension the caller built in place
#                        (python setup.py build_ext --inplace) instead of pip install -e
#   TEST_SHARDS=2        runs the test files in that many pytest processes at
#                        once (files dealt round-robin; one log per shard)
#   TEST_WORKERS=12      instead: one pytest over pytest-xdist workers (-n 12), which
#                        balances tests, not files (the contract file is a third of the suite)
#   TEST_K="cuda"        pytest -k expression (e.g. only the CUDA variants, when CI has run
#                        the CPU ones)
#   SANITIZE_WITH_TESTS=1  the sanitizer tools run in background processes beside the
#                        tests (each tool one process) instead of after them
#   SKIP_TESTS=1         no test stage (e.g. a sanitizer-only or timing-only run)
#   SANITIZE_TOOLS=none  no compute-sanitizer stage
#   SANITIZE_TIMEOUT=420 seconds per sanitizer tool (racecheck is the slowest)
#   KERNEL_ARGS="--train --ops vae"   arguments of the kernel-timing stage
#   COMPARE_WITH=old.tar.gz COMPARE_ARGS="--device cuda --ops importance_sampling --no-compile"
#       also builds that source tree (a `git archive` of another commit) in
#       place and times it against the build under test in one process pair
#       per round (tools/compare_builds.py) -> $OUT/compare/compare-builds.{md,json}
#
# A copy of the tree without .git can pass FUSED_OPS_GIT_COMMIT=<sha> so the
# benchmark results record the commit they measured.
# Made for the device tool (at most 8 files come back): the logs are packed
# into one tarball; the benchmark's JSON/markdown/PNG and a summary sit beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-16}
export PYTHONUNBUFFERED=1
# Build with the system compiler (the one torch was built with): a CXX that
# brings its own libstdc++ (some GPU images set one) builds an extension that
# crashes in libstdc++ stream code on its first error message.
export CXX=${FUSED_OPS_CXX:-g++} CC=${FUSED_OPS_CC:-gcc}
PY=${PYTHON:-python3}
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"

stage() {  # stage NAME CMD...: run, log, record status and duration
  local name=$1
  shift
  local t0=$SECONDS
  "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  printf '%-12s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$SUMMARY"
  return $rc
}

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", sys.version.split()[0])'
  nvcc --version | tail -n 2
} | tee -a "$SUMMARY"

REPO=$PWD
if [[ -n "${FUSED_OPS_WHEEL:-}" ]]; then
  SITE=$(mktemp -d)/site
  if ! stage install $PY -m pip install --no-deps --target "$SITE" "$FUSED_OPS_WHEEL"; then
    tail -n 30 "$LOGS/install.log"
    tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
    exit 1
  fi
  export PYTHONPATH=$SITE FUSED_OPS_TEST_INSTALLED=1
  # Run from a directory holding only copies of bench/ and tools/, so `import
  # fused_ops` finds the installed wheel, never ./fused_ops of the source tree.
  RUN_DIR=$(mktemp -d)
  cp -r bench tools "$RUN_DIR/"
elif [[ -n "${SKIP_BUILD:-}" ]]; then
  # The caller built the extension in place (setup.py build_ext --inplace).
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
  RUN_DIR=$REPO
elif ! stage build $PY -m pip install --no-build-isolation --no-deps -v -e .; then
  tail -n 60 "$LOGS/build.log"
  tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
  exit 1
else
  RUN_DIR=$REPO
fi
cd "$RUN_DIR"
$PY -c 'import fused_ops, json; print("fused_ops from", fused_ops.__file__); print(json.dumps(fused_ops.info()))' | tee -a "$SUMMARY"
# TEST_FILES narrows the suite (paths relative to tests/), e.g. for a re-run.
TEST_PATHS=("$REPO/tests")
if [[ -n "${TEST_FILES:-}" ]]; then TEST_PATHS=(); for f in $TEST_FILES; do TEST_PATHS+=("$REPO/tests/$f"); done; fi
sanitize() {  # sanitize TOOL: compute-sanitizer over tools/sanitize_run.py's cases
  stage "$1" timeout ${SANITIZE_TIMEOUT:-420} compute-sanitizer --tool "$1" --error-exitcode 99 $PY "$RUN_DIR/tools/sanitize_run.py" ${SANITIZE_GROUPS:-}
}
SANITIZE_PIDS=()
if [[ -n "${SANITIZE_WITH_TESTS:-}" ]]; then
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
    [[ $tool == none ]] && continue
    sanitize "$tool" &
    SANITIZE_PIDS+=($!)
  done
fi
K_ARGS=()
[[ -n "${TEST_K:-}" ]] && K_ARGS=(-k "$TEST_K")
if [[ -z "${SKIP_TESTS:-}" ]]; then
  SHARDS=${TEST_SHARDS:-1}
  if [[ -n "${TEST_WORKERS:-}" ]]; then
    stage tests timeout ${TESTS_TIMEOUT:-420} $PY -m pytest -q -ra -p no:cacheprovider -n "$TEST_WORKERS" \
      --timeout ${TEST_TIMEOUT:-300} "${K_ARGS[@]}" "${TEST_PATHS[@]}"
    grep -E "^(FAILED|ERROR)" "$LOGS/tests.log" | head -n 60 | tee -a "$SUMMARY"
    tail -n 3 "$LOGS/tests.log" | tee -a "$SUMMARY"
  elif (( SHARDS <= 1 )); then
    stage tests timeout ${TESTS_TIMEOUT:-420} $PY -m pytest -q -ra -p no:cacheprovider "${K_ARGS[@]}" "${TEST_PATHS[@]}"
    tail -n 15 "$LOGS/tests.log"
  else
    FILES=()
    for p in "${TEST_PATHS[@]}"; do
      if [[ -d $p ]]; then FILES+=("$p"/test_*.py); else FILES+=("$p"); fi
    done
    pids=()
    for ((k = 0; k < SHARDS; k++)); do
      part=()
      for ((j = k; j < ${#FILES[@]}; j += SHARDS)); do part+=("${FILES[j]}"); done
      (( ${#part[@]} )) || continue
      stage "tests$k" timeout ${TESTS_TIMEOUT:-420} $PY -m pytest -q -ra -p no:cacheprovider --rootdir "$REPO" "${K_ARGS[@]}" "${part[@]}" &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    for ((k = 0; k < SHARDS; k++)); do
      [[ -f $LOGS/tests$k.log ]] && { echo "== shard $k"; tail -n 12 "$LOGS/tests$k.log"; } | tee -a "$SUMMARY"
    done
  fi
fi
for pid in "${SANITIZE_PIDS[@]}"; do wait "$pid"; done
for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
  [[ $tool == none ]] && continue
  [[ -z "${SANITIZE_WITH_TESTS:-}" ]] && sanitize "$tool"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|MISMATCH|^summary:" "$LOGS/$tool.log" | tee -a "$SUMMARY"
done
if [[ -n "${COMPARE_WITH:-}" ]]; then
  # The other build: its source tree built in place with the same compiler,
  # architectures and torch; the build under test is the wheel's site or the
  # in-place build of this tree.
  case $COMPARE_WITH in /*) ARCHIVE=$COMPARE_WITH ;; *) ARCHIVE=$REPO/$COMPARE_WITH ;; esac
  OTHER=$(mktemp -d)/src
  mkdir -p "$OTHER" && tar -xzf "$ARCHIVE" -C "$OTHER"
  if stage build_other bash -c "cd '$OTHER' && FORCE_CUDA=1 $PY setup.py build_ext --inplace"; then
    stage compare timeout ${COMPARE_TIMEOUT:-300} $PY -m tools.compare_builds \
      --build "${COMPARE_LABEL:-current}=${SITE:-$REPO}" --build "${COMPARE_OTHER_LABEL:-other}=$OTHER" \
      --rounds ${COMPARE_ROUNDS:-3} --out "$OUT/compare" -- ${COMPARE_ARGS:---device cuda --ops importance_sampling --no-compile}
    tail -n 8 "$LOGS/compare.log" | tee -a "$SUMMARY"
    # Only the summary files come back (the device tool returns few files).
    tar -czf "$LOGS/compare-rounds.tar.gz" -C "$OUT/compare" --exclude='compare-builds.*' .
    find "$OUT/compare" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
  else
    tail -n 30 "$LOGS/build_other.log"
  fi
fi
if [[ -z "${SKIP_BENCH:-}" ]]; then
stage kernels timeout 120 $PY -m tools.kernel_timing ${KERNEL_ARGS:-}
cat "$LOGS/kernels.log"
for mode in ${BENCH_MODES:-forward}; do
  case $mode in forward) MODE_ARGS=() ;; train) MODE_ARGS=(--train) ;; *) echo "unknown BENCH_MODES entry $mode"; continue ;; esac
  stage "bench-$mode" timeout ${BENCH_TIMEOUT:-420} $PY -m bench.benchmark --device cuda --out "$OUT" "${MODE_ARGS[@]}" ${BENCH_ARGS:-}
  cat "$LOGS/bench-$mode.log"
done
fi
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
cat "$SUMMARY"
