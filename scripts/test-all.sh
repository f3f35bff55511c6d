#!/usr/bin/env bash
# `make test`: everything CI checks, on both LibTorch paths.
#   1. install what is missing (scripts/install-deps.sh, idempotent), the instructor's slide,
#      docs and lint tools included (a learner's `make run` installs none of them);
#   2. primary path (build/, PyPI torch 2.x) and light path (build-light/, Debian 1.13):
#      configure, build everything, run every test except the learner suites, which fail on the
#      untouched exercises by design; the bite checks (lessonNN.bite) run those instead and
#      require that they fail on every TODO;
#   3. one summary line, "test: N passed, M failed", where a path that fails to install, configure
#      or build counts its failures too (one per failed step or target, plus its tests that
#      could not be built), so that a broken path never reads as a green line.
# Set DTC_PATHS="primary" or "light" to run one path only.
#
# With both paths, the light path is installed, configured and built beside the primary path
# (DTC_OVERLAP=0: one after the other): the tools' and the light path's Debian packages download
# while the primary path compiles, and the light build runs at the lowest CPU priority (nice 19),
# so that it takes only what the primary path leaves idle (its tests wait on launches, sockets and
# timeouts about a tenth of the time) and the primary tests run as they would alone. Its output
# is kept in build-light/test-all-build.log and printed once the primary tests are done. The
# light tests start after both, on the whole machine.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
paths=${DTC_PATHS:-"primary light"}
jobs=${JOBS:-$(nproc)}
passed=0 failed=0 status=0
summary=()

for path in $paths; do
  case $path in primary|light) ;; *)
    echo "unknown path '$path' in DTC_PATHS (use primary and/or light)"; exit 2 ;;
  esac
done

# fail_step PATH WHAT N: a step that failed before any test could run counts as N failures in the
# closing line (a path that cannot install, configure or build is not a passing path).
fail_step() {
  echo "=== $1 path: $2 FAILED"
  summary+=("$1: $2 failed (counted as $3 failed)")
  failed=$((failed + $3))
  status=1
}

# prepare_path PATH BUILD DEPS CONFIGURE: install, configure, build (-k 0: everything that can be
# built). Prints "FAIL<tab>what<tab>n" for each failed step, and returns 1 when the path cannot
# be tested at all. NICE: a prefix for the build command.
prepare_path() {
  local path=$1 build=$2 deps_target=$3 configure_target=$4 nice=${5:-} configured=0
  if ! make --no-print-directory "$deps_target" >&2; then printf 'FAIL\tinstall\t1\n'; return 1; fi
  [ -f "$build/build.ninja" ] && configured=1
  if ! make --no-print-directory "$configure_target" >&2; then printf 'FAIL\tconfigure\t1\n'; return 1; fi
  # A build folder configured before the tools were installed (a learner's `make run`) has not
  # found clang-format: configure it again, which looks again (5 s). One configured just now has.
  if ((configured)) && ! cmake "$build" >/dev/null; then
    printf 'FAIL\tconfigure\t1\n'; return 1
  fi
  # Each target that did not build is one failure here, and its tests fail in ctest as
  # <target>_NOT_BUILT.
  local blog build_failures=0
  blog=$(mktemp)
  $nice cmake --build "$build" -j "$jobs" -- -k 0 2>&1 | tee "$blog" >&2
  if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    build_failures=$(grep -c '^FAILED: ' "$blog")
    [ "$build_failures" -gt 0 ] || build_failures=1
    printf 'FAIL\tbuild of %s target(s)\t%s\n' "$build_failures" "$build_failures"
  fi
  rm -f "$blog"
  return 0
}

# record PATH FILE: counts the failures prepare_path printed into FILE (its "FAIL" lines).
record() {
  local path=$1 file=$2 tag what n
  while IFS=$'\t' read -r tag what n; do
    [ "$tag" = FAIL ] && fail_step "$path" "$what" "$n"
  done <"$file"
}

test_path() {
  local path=$1 build=$2 build_note=$3 t0=$SECONDS log
  log=$(mktemp)
  ctest --test-dir "$build" -LE learner -j "$jobs" --output-on-failure --timeout 300 \
    --output-junit "$PWD/$build/junit.xml" | tee "$log"
  local rc=${PIPESTATUS[0]}
  local line p f
  line=$(grep -E '[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -1)
  rm -f "$log"
  if [ -z "$line" ]; then fail_step "$path" "ctest (no result line)" 1; return; fi
  f=$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"$line")
  p=$(( $(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$line") - f ))
  passed=$((passed + p)) failed=$((failed + f))
  summary+=("$path: $p passed, $f failed ($build_note, tests $((SECONDS - t0)) s)")
  [ "$rc" -eq 0 ] || status=1
}

# run_path PATH BUILD DEPS CONFIGURE: one path, start to end, in the foreground.
run_path() {
  local path=$1 build=$2 t0=$SECONDS state
  echo "=== $path path: $build/"
  state=$(mktemp)
  prepare_path "$@" >"$state"
  local ok=$?
  record "$path" "$state"
  rm -f "$state"
  [ "$ok" -eq 0 ] && test_path "$path" "$build" "build $((SECONDS - t0)) s"
}

tools() {
  [ -n "${DTC_SKIP_DEPS:-}" ] || make --no-print-directory deps-tools
}

if [ "$paths" = "primary light" ] && [ "${DTC_OVERLAP:-1}" != 0 ]; then
  # The primary path's own installs first (a learner's `make run` did them already): apt takes
  # one install at a time, and the light path's runs beside the primary build.
  echo "=== primary path: build/"
  t0=$SECONDS
  pstate=$(mktemp) lstate=$(mktemp) tstate=$(mktemp)
  mkdir -p build-light
  lightlog=build-light/test-all-build.log
  pok=0
  if ! make --no-print-directory deps; then
    printf 'FAIL\tinstall\t1\n' >"$pstate"; pok=1
  fi
  # Beside it: the tools, then the light path's install, configure and (nice 19) build.
  (
    lt0=$SECONDS
    tools >"$lightlog" 2>&1
    echo $? >"$tstate"
    echo "=== light path: build-light/ (beside the primary path)" >>"$lightlog"
    prepare_path light build-light deps-light configure-light "nice -n 19" >"$lstate" 2>>"$lightlog"
    lok=$?
    printf 'DONE\t%s\t%s\n' "$lok" "$((SECONDS - lt0))" >>"$lstate"
  ) &
  bg=$!
  if [ "$pok" -eq 0 ]; then
    prepare_path primary build deps configure >>"$pstate" || pok=1
  fi
  pbuild=$((SECONDS - t0))
  # The tools (clang-format, Doxygen, pandoc, Chromium) before the primary tests, which use them.
  while [ ! -s "$tstate" ] && kill -0 "$bg" 2>/dev/null; do sleep 1; done
  if [ "$(cat "$tstate" 2>/dev/null)" != 0 ]; then fail_step tools "install" 1; fi
  record primary "$pstate"
  if [ "$pok" -eq 0 ]; then
    # Configure again to find the tools if they were installed since the configure (or cannot be
    # told: no stamp, DTC_SKIP_DEPS).
    stamp=${DTC_CACHE:-}/deps-tools.stamp
    if [ -z "${DTC_CACHE:-}" ] || [ ! -f "$stamp" ] || [ "$stamp" -nt build/CMakeCache.txt ]; then
      cmake build >/dev/null
    fi
    test_path primary build "build ${pbuild} s"
  fi
  tw=$SECONDS
  wait "$bg"
  echo "=== light path: build-light/ (its install, configure and build ran beside the primary path)"
  cat "$lightlog"
  lok=$(awk -F'\t' '$1 == "DONE" {print $2}' "$lstate")
  lbuild=$(awk -F'\t' '$1 == "DONE" {print $3}' "$lstate")
  record light "$lstate"
  [ "$lok" = 0 ] && test_path light build-light \
    "build ${lbuild:-?} s beside the primary path, $((SECONDS - tw)) s after it"
  rm -f "$pstate" "$lstate" "$tstate"
else
  tools || fail_step tools "install" 1
  for path in $paths; do
    case $path in
      primary) run_path primary build deps configure ;;
      light) run_path light build-light deps-light configure-light ;;
    esac
  done
fi
echo
for line in "${summary[@]}"; do echo "  $line"; done
echo "test: $passed passed, $failed failed"
exit $status
