#!/usr/bin/env bash
# Times the learner's loop, lesson by lesson: change one exercise file, then `make test-lessonNN`
# (rebuild what depends on it, run the learner suite). Also the instructor's twin: change the
# solution, `make test-lessonNN-solution`, where every test runs to completion.
#
#   bench/learner_loop.sh                 # every lesson, quiet machine
#   bench/learner_loop.sh --load 1        # with 1 busy core beside it (a "loaded" machine)
#   bench/learner_loop.sh 03 06           # some lessons
#
# A change is a comment line appended to the file and removed afterwards (the file is restored
# even on Ctrl-C); ccache is off here (CCACHE_DISABLE=1), since a comment alone would be a cache
# hit and a learner's real edit is not. Needs a configured and
# built build/ (make build). Prints one row per lesson: seconds to build, to test, in all.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export CCACHE_DISABLE=1
load=0
lessons=()
while [ $# -gt 0 ]; do
  case "$1" in
    --load) load=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) lessons+=("$1"); shift ;;
  esac
done
if [ ${#lessons[@]} -eq 0 ]; then
  for d in lessons/[0-9][0-9]_*/; do lessons+=("$(basename "$d" | cut -c1-2)"); done
fi
[ -f build/build.ninja ] || { echo "learner_loop: build/ is not configured; run make build" >&2; exit 2; }

load_pids=()
touched=""
cleanup() {
  [ -n "$touched" ] && [ -f "$touched.loopbak" ] && mv "$touched.loopbak" "$touched"
  for p in "${load_pids[@]}"; do kill "$p" 2>/dev/null; done
}
trap cleanup EXIT INT TERM
for ((i = 0; i < load; i++)); do (while :; do :; done) & load_pids+=($!); done

# The exercise file of lesson NN: the first source in its lesson.cmake's SOURCES.
exercise_of() {
  local dir=$1
  sed -n 's/.*SOURCES \([^ ]*\).*/\1/p' "$dir/lesson.cmake" | head -1
}

# cycle FILE TARGET: append a comment to FILE, time the build and the tests of TARGET.
cycle() {
  local file=$1 target=$2 t0 t1 t2
  touched=$file
  cp "$file" "$file.loopbak"
  echo "// learner_loop $(date +%s%N)" >> "$file"
  local nn=${target//[^0-9]/}
  local build_target=lesson${nn}_tests
  [[ $target == *solution ]] && build_target=lesson${nn}_solution_tests
  t0=$(date +%s.%N)
  cmake --build build --target "$build_target" > /dev/null 2>&1
  t1=$(date +%s.%N)
  make --no-print-directory "$target" > /dev/null 2>&1
  t2=$(date +%s.%N)
  mv "$file.loopbak" "$file"
  touched=""
  # Put the build back as it was (not timed).
  cmake --build build --target "$build_target" > /dev/null 2>&1
  awk -v a="$t0" -v b="$t1" -v c="$t2" 'BEGIN {printf "%6.1f %6.1f %6.1f", b - a, c - b, c - a}'
}

printf '%-8s | %-22s | %-22s\n' "" "exercise: test-lessonNN" "solution: ...-solution"
printf '%-8s | %6s %6s %6s | %6s %6s %6s\n' lesson build test total build test total
for nn in "${lessons[@]}"; do
  dir=$(ls -d lessons/"$nn"_*/ | head -1)
  dir=${dir%/}
  src=$(exercise_of "$dir")
  topic=$(basename "$dir")
  ex=$(cycle "$dir/$src" "test-lesson$nn")
  sol=$(cycle "solutions/$topic/$src" "test-lesson$nn-solution")
  printf '%-8s | %s | %s\n' "$nn" "$ex" "$sol"
done
echo "(seconds; load: $load busy core(s) beside the loop; $(nproc) cores)"
