#!/usr/bin/env bash
# Rehearses scripts/gpu-check.sh as a GPU node would run it, on a machine without a GPU: a fresh
# Debian 12 root (scripts/fresh-check.sh) with only what such a node has — a compiler, CMake,
# ninja and a Python with PyTorch of the node's version — and no Debian development package
# (no CLI11, nlohmann_json, fmt, gloo, GoogleTest or OpenMPI). The bundle made here by
# scripts/gpu-bundle.sh is copied in, and the check runs with --cpu --bundle: configure and build
# from the bundle alone, then every step that runs on a CPU. Not part of `make test`.
#
#   sudo scripts/gpu-rehearsal.sh                      # torch 2.11.0, logs in ./gpu-rehearsal
#   sudo scripts/gpu-rehearsal.sh --torch 2.12.1 --out DIR --keep
#
# The node's torch is PyPI's wheel of that version (a CUDA build, as on the node; it runs on the
# CPU here). The node has a CUDA toolkit and this root has none, so the CUDA runtime's headers
# come from the wheel (cmake/DtcTorch.cmake; nvidia-cuda-crt from PyPI, as install-deps.sh does)
# and nccl_raw, which needs the toolkit, is not built: the one step a rehearsal cannot cover.
# Exit 0 when every step passed; the check's own summary is DIR/gpu-check/summary.md.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
torch=2.11.0
out=$PWD/gpu-rehearsal
root=/var/tmp/dtc-gpu-rehearsal-root
keep=0
# Inside the root: the proof that no development package of the course's lists came along.
assert_no_dev() {
  local p found=0
  for p in $(sed -n 's/^[a-z]*:[[:space:]]*//p' "$here/packages.txt" | tr ' ' '\n' |
             grep -E -- '-dev$|^googletest$' | sort -u); do
    if dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
      echo "installed: $p"; found=1
    else
      echo "absent: $p"
    fi
  done
  return $found
}

while [ $# -gt 0 ]; do
  case "$1" in
    --assert-no-dev) assert_no_dev; exit $? ;;
    --torch) torch=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --root) root=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "gpu-rehearsal: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)

bundle="$out/bundle"
"$here/gpu-bundle.sh" "$bundle" || exit 1

# What a GPU node has besides its GPU stack.
node_tools=build-essential,cmake,ninja-build,python3,python3-venv
venv="DTC_VENV=/opt/node-python DTC_TORCH_VERSION=$torch scripts/install-deps.sh venv"
check="TORCH_PYTHON=/opt/node-python/bin/python scripts/gpu-check.sh --cpu --bundle /root/bundle --out /root/gpu-check --budget 7200"

"$here/fresh-check.sh" --root "$root" --out "$out" --include "$node_tools" \
  --copy "$bundle:/root/bundle" --keep --timeout 7200 \
  --commands "scripts/gpu-rehearsal.sh --assert-no-dev" "$venv" "$check"
rc=$?
# The check's own output, out of the root; then the root goes, unless kept or failed.
if [ -d "$root/root/gpu-check" ]; then
  rm -rf "$out/gpu-check" && cp -r "$root/root/gpu-check" "$out/gpu-check"
  echo "gpu-rehearsal: the check's summary: $out/gpu-check/summary.md"
fi
if [ $rc -eq 0 ] && [ $keep -eq 0 ]; then
  rm -rf "$root"
else
  echo "gpu-rehearsal: root kept in $root"
fi
exit $rc
