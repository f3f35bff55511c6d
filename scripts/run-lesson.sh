#!/usr/bin/env bash
# Runs a lesson's program the way its README shows: directly for single-process lessons,
# under torchrun with NPROC ranks (default 2) for the others.
#   scripts/run-lesson.sh BUILD_DIR NN[_solution] [program arguments...]
set -euo pipefail
build=$1 nn=$2
shift 2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/paths.sh"
program="$build/bin/lesson$nn"
case "$nn" in
  01|01_solution|02|02_solution) exec "$program" "$@" ;;  # one process: no ranks
esac
nproc=${NPROC:-2}
# Lesson 12 survives a failed rank: torchrun restarts the job (MAX_RESTARTS times, default 1).
restarts=()
case "$nn" in 12|12_solution) restarts=(--max_restarts="${MAX_RESTARTS:-1}") ;; esac
if [ -x "$DTC_VENV/bin/torchrun" ] && [ "$build" != "build-light" ]; then
  exec "$DTC_VENV/bin/torchrun" --standalone --nproc_per_node="$nproc" "${restarts[@]}" \
    --no_python "$program" "$@"
fi
# Debian's torchrun 1.13 crashes under Python 3.11 unless output redirection is explicit.
exec torchrun --standalone --nproc_per_node="$nproc" "${restarts[@]}" --redirects 2 --tee 2 \
  --no_python "$program" "$@"
