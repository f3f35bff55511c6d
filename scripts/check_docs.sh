#!/usr/bin/env bash
# Builds the API docs (Doxygen: common library, lesson contracts, lesson READMEs as pages) into
# OUT (default build/docs) and fails on any Doxygen warning.
#   scripts/check_docs.sh [OUT]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-build/docs}
mkdir -p "$out"
log="$out/doxygen-warnings.log"
{ cat docs/Doxyfile; echo "OUTPUT_DIRECTORY = $out"; echo "WARN_LOGFILE = $log"; } | doxygen - >/dev/null
if [ -s "$log" ]; then
  cat "$log" >&2
  echo "docs: $(wc -l <"$log") Doxygen warning(s); fix them (see above)" >&2
  exit 1
fi
echo "docs: $out/html/index.html, no warnings"
