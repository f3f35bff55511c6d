#!/usr/bin/env bash
# The compiler launcher (CMAKE_CXX_COMPILER_LAUNCHER): `ccache-launcher.sh CCACHE COMPILER ARGS`.
#
# Every compilation goes through ccache, except a precompiled header's: that one is compiled
# directly, and beside it goes a checksum (HEADER.pch.sum, HEADER.gch.sum) that ccache hashes
# instead of the header (sloppiness pch_external_checksum, set by the Makefile). The compiler
# writes the clone's own paths into a precompiled header (Clang's: about 3,000 bytes differ
# between two clones; GCC's: millions), so hashing the header itself gave every file that uses
# it a different key in every clone, and a second clone rebuilt all of LibTorch's part. The
# checksum covers what the header's content is made of: the compiler's identity, its arguments
# (the clone's and the build folder's paths taken out) and the preprocessed text of every header
# it includes. If that cannot be computed, no checksum is written and ccache hashes the header
# itself, as before.
set -uo pipefail
ccache=$1
shift
args=("$@")
pch=0
out=
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    -emit-pch | c++-header) pch=1 ;;  # Clang: -Xclang -emit-pch; GCC: -x c++-header
    -o) out=${args[i + 1]} ;;
  esac
done
if ((pch == 0)) || [[ -z $out ]]; then
  # ccache makes paths relative to CCACHE_BASEDIR, except those behind -Xclang: CMake's
  # `-Xclang -include -Xclang BUILD/.../cmake_pch.hxx`. Those in the build folder (the working
  # directory) are given relative here, so that the key is the same in every clone.
  for ((i = 1; i < ${#args[@]}; i++)); do
    if [[ ${args[i - 1]} == -Xclang && ${args[i]} == "$PWD/"* ]]; then
      args[i]=${args[i]#"$PWD/"}
    fi
  done
  exec "$ccache" "${args[@]}"
fi

rm -f "$out.sum"
"$@" || exit $?

# The same command, preprocessing only: -E -P to standard output (no line markers, whose paths
# are the clone's), without the header output, the dependency file and -emit-pch.
pp=()
for ((i = 0; i < ${#args[@]}; i++)); do
  a=${args[i]}
  case $a in
    -o | -MT | -MF | -MQ) ((i++)); continue ;;
    -c | -MD | -MMD) continue ;;
    -Xclang)
      if [[ ${args[i + 1]:-} == -emit-pch ]]; then ((i++)); continue; fi ;;
  esac
  pp+=("$a")
done
text=$("${pp[@]}" -E -P -o - 2>/dev/null | sha256sum) || exit 0
key=$(
  {
    "${args[0]}" --version
    for a in "${args[@]}"; do
      a=${a//"$PWD/"/}
      [[ -n ${CCACHE_BASEDIR:-} ]] && a=${a//"${CCACHE_BASEDIR%/}/"/}
      printf '%s\n' "$a"
    done
    printf '%s\n' "$text"
  } | sha256sum
) || exit 0
printf '%s\n' "${key%% *}" > "$out.sum.tmp" && mv -f "$out.sum.tmp" "$out.sum"
exit 0
