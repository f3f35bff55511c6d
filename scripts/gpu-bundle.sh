#!/usr/bin/env bash
# Gathers what the course needs beyond a GPU node's own PyTorch, CUDA, compiler, CMake and ninja
# into one folder (at most 64 MiB), for a node with no package registry:
#   DIR/include/     CLI11, nlohmann_json, fmt (header-only) and gloo's headers
#   DIR/googletest/  GoogleTest's sources (built on the node, as part of the course's build)
#   DIR/MANIFEST     each Debian package copied, with its version, and the bundle's size
# The packages are scripts/packages.txt's "bundle" group; the files are what dpkg says each of
# them installed under /usr/include and /usr/src/googletest. Run it where those packages are
# installed (scripts/install-deps.sh primary), then carry DIR to the node:
#
#   scripts/gpu-bundle.sh build-bundle
#   scripts/gpu-check.sh --bundle build-bundle --out gpu-out        # on the node
#   cmake -S . -B build-gpu -G Ninja -DDTC_BUNDLE=$PWD/build-bundle ...   # or by hand
#
# Nothing else is needed there: nccl_raw runs without MPI (torchrun, its ranks share NCCL's id
# through a file), and the tests' Python needs only the node's torch.
set -euo pipefail

limit_mib=64
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ $# -ne 1 ] || [[ $1 == -* ]]; then
  awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"
  [ $# -eq 1 ] && [[ $1 == -h || $1 == --help ]] && exit 0
  echo "usage: $0 DIR" >&2
  exit 2
fi
out=$1
packages=$(sed -n 's/^bundle:[[:space:]]*//p' "$here/packages.txt" | tr -s ' \n' ' ')
missing=()
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu-bundle: not installed here: ${missing[*]}" >&2
  echo "HINT: scripts/install-deps.sh primary installs them (they are Debian packages)" >&2
  exit 1
fi

rm -rf "$out"
mkdir -p "$out/include" "$out/googletest"
{
  echo "# The course's GPU bundle: made by scripts/gpu-bundle.sh on $(date -u +%Y-%m-%d)"
  echo "# from Debian $(cat /etc/debian_version 2>/dev/null || echo '?'): package version"
} > "$out/MANIFEST"
for p in $packages; do
  echo "$p $(dpkg-query -W -f='${Version}' "$p")" >> "$out/MANIFEST"
  while IFS= read -r f; do
    [ -f "$f" ] || continue
    case "$f" in
      /usr/include/*) dest="$out/include/${f#/usr/include/}" ;;
      /usr/src/googletest/*) dest="$out/googletest/${f#/usr/src/googletest/}" ;;
      *) continue ;;
    esac
    mkdir -p "$(dirname "$dest")"
    cp -p "$f" "$dest"
  done < <(dpkg -L "$p")
done
# gmock is not needed (cmake/DtcBundle.cmake builds GoogleTest with BUILD_GMOCK=OFF).
rm -rf "$out/googletest/googlemock"

bytes=$(du -sb "$out" | cut -f1)
echo "# size: $bytes bytes" >> "$out/MANIFEST"
mib=$(( (bytes + 1048575) / 1048576 ))
echo "gpu-bundle: $out: $(find "$out" -type f | wc -l) files, $bytes bytes (limit ${limit_mib} MiB)"
if [ "$mib" -gt "$limit_mib" ]; then
  echo "gpu-bundle: $out is ${mib} MiB, over the ${limit_mib} MiB limit" >&2
  exit 1
fi
