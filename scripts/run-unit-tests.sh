#!/usr/bin/env bash
# Runs one lesson's unit tests in one process: what `make test-lessonNN` does before the
# end-to-end runs.
#
#   scripts/run-unit-tests.sh BUILD NN [learner|solution]
#
# One process starts LibTorch once (about 0.6 s of its static initialisation) instead of once
# per test: a lesson's suite takes about 1 s instead of 7-9 s. GoogleTest prints each failure
# with its message (your TODO's hint, got / expected) and a summary. (ctest runs each program
# once too, tests/support/gtest_once.py, and reports its tests one by one.)
#
# One process cannot survive a crash, or bound each test's time. So if the program dies on a
# signal, or runs past DTC_UNIT_TIMEOUT seconds (default 300), this script says so and runs each
# test in its own process through ctest (DTC_GTEST_ISOLATE=1, 120 s per test), which names the
# test that crashes. ISOLATE=1 does that from the start. Exit status: 0 when every test passed.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: scripts/run-unit-tests.sh BUILD NN [learner|solution]" >&2
  exit 2
fi
build=$1 nn=$2 flavour=${3:-learner}
case "$flavour" in
  learner) suffix="" ;;
  solution) suffix="_solution" ;;
  *) echo "run-unit-tests: flavour '$flavour' is neither learner nor solution" >&2; exit 2 ;;
esac
prog="$build/tests/lesson${nn}${suffix}_tests"
if [ ! -x "$prog" ]; then
  echo "run-unit-tests: $prog is not built; run: cmake --build $build --target lesson${nn}${suffix}_tests" >&2
  exit 2
fi
limit=${DTC_UNIT_TIMEOUT:-300}
# One intra-op thread per thread-rank, as under ctest (tests/support/gtest_once.py says why).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

isolated() {
  echo "run-unit-tests: running each test of lesson $nn in its own process (ctest):"
  DTC_GTEST_ISOLATE=1 ctest --test-dir "$build" -L "^lesson${nn}-${flavour}\$" -LE '^e2e$' \
    --output-on-failure \
    -j "$(nproc)"
}
if [ -n "${ISOLATE:-}" ]; then
  isolated
  exit $?
fi

# ctest runs the tests from the build folder: so does this, so that relative paths agree.
abs_prog=$(cd "$(dirname "$prog")" && pwd)/$(basename "$prog")
echo "lesson $nn, $flavour: $prog --gtest_brief=1   (one test: --gtest_filter='Suite.Test')"
log=$(mktemp)
json=$(mktemp --suffix=.json)
trap 'rm -f "$log" "$json"' EXIT
(cd "$build" && timeout -k 5 "$limit" "$abs_prog" --gtest_brief=1 --gtest_output="json:$json") 2>&1 |
  tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 1 ]; then
  # Brief mode prints no list of what failed: the list, in the order the tests ran.
  failed=$(sed -n 's/^\[  FAILED  \] \([^ ]*\) (.*/\1/p' "$log")
  echo "[  FAILED  ] $(echo "$failed" | wc -l) tests, in the order they ran (start with the first):"
  echo "$failed" | sed 's/^/[  FAILED  ] /'
fi
# The learner's summary: how many tests pass, part by part of the exercise, and what to do next
# (scripts/test_summary.py).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
lesson_dir=$(ls -d "$here/../lessons/${nn}_"* 2>/dev/null | head -1)
if [ "$flavour" = learner ] && [ "$rc" -le 1 ] && [ -n "$lesson_dir" ]; then
  python3 "$here/test_summary.py" "$json" "$lesson_dir" "$nn" || true
fi
[ "$rc" -le 1 ] && exit "$rc"

if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  why="did not finish in $limit s"
else
  why="died (exit status $rc$([ "$rc" -gt 128 ] && echo ", signal $((rc - 128))"))"
fi
echo
echo "run-unit-tests: the test program $why; ctest will name the test that does."
isolated
exit 1
