#!/usr/bin/env bash
# The compiler launcher (CMAKE_CXX_COMPILER_LAUNCHER): `ccache-launcher.sh CCACHE COMPILER ARGS`.
#
# Every compilation goes through ccache, except a precompiled header's: ccache cannot reuse one
# across clones, since the compiler writes the clone's own paths into it (Clang's: about 3,000
# bytes differ between two clones; GCC's: millions), and Clang refuses a header whose recorded
# source file is gone. Instead:
#   - its key is a checksum of what its content is made of: the compiler's identity, its
#     arguments (the clone's and the build folder's paths taken out) and the preprocessed text
#     of every header it includes;
#   - with DTC_PCH_CACHE set (the Makefile: $DTC_CACHE/pch), it is compiled once per key, in
#     DTC_PCH_CACHE/<key>/ from a copy of the header there, a path that is the same for every
#     clone and build folder, and linked (or copied) into the build folder; its dependency file
#     names that copy, so that a build folder whose entry was deleted compiles it again;
#   - the key goes beside it (HEADER.pch.sum, HEADER.gch.sum), and ccache hashes that instead
#     of the header (sloppiness pch_external_checksum, set by the Makefile): the files that use
#     it hit the cache in every clone.
# If the key cannot be computed, the header is compiled in the build folder with no checksum,
# and ccache hashes the header itself.
set -uo pipefail
ccache=$1
shift
args=("$@")
pch=0
out=
depfile=
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    -emit-pch | c++-header) pch=1 ;;  # Clang: -Xclang -emit-pch; GCC: -x c++-header
    -o) out=${args[i + 1]} ;;
    -MF) depfile=${args[i + 1]} ;;
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

rm -f "$out" "$out.sum"  # never write through a link into the shared copy

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
key=
if text=$("${pp[@]}" -E -P -o - 2>/dev/null | sha256sum); then
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
  ) && key=${key%% *} || key=
fi
write_key() { printf '%s\n' "$key" > "$out.sum.tmp" && mv -f "$out.sum.tmp" "$out.sum"; }
# compile_here: the header compiled in the build folder, with its key beside it if there is one.
compile_here() {
  "$@" || exit $?
  if [[ -n $key ]]; then write_key; fi
  exit 0
}
[[ -n $key && -n ${DTC_PCH_CACHE:-} ]] || compile_here "$@"

# The shared copy: the header and its source file (CMake's cmake_pch.hxx and cmake_pch.hxx.cxx)
# copied into the entry, compiled there under a lock (two builds may ask at once), and the
# result renamed into place last, so that a present "pch" file is a whole one.
entry=$DTC_PCH_CACHE/$key
# A cache folder that cannot be written: compiled here, as without one.
{ mkdir -p "$entry" && exec 9>"$entry/lock" && flock 9; } 2>/dev/null || compile_here "$@"
if [[ ! -f $entry/pch ]]; then
  run=()
  for ((i = 0; i < ${#args[@]}; i++)); do
    a=${args[i]}
    case $a in
      -o) run+=(-o "$entry/pch.tmp"); ((i++)); continue ;;
      -MF) run+=(-MF "$entry/deps.tmp"); ((i++)); continue ;;
      *.hxx | *.hxx.cxx)
        if [[ -f $a ]]; then
          cp -f "$a" "$entry/${a##*/}" || exit 1
          a=$entry/${a##*/}
        fi ;;
    esac
    run+=("$a")
  done
  "${run[@]}" || exit $?
  if [[ -n $depfile ]]; then mv -f "$entry/deps.tmp" "$entry/deps" || exit 1; fi
  mv -f "$entry/pch.tmp" "$entry/pch" || exit 1
fi
ln -f "$entry/pch" "$out" 2>/dev/null || cp -f "$entry/pch" "$out" || exit 1
if [[ -n $depfile ]]; then cp -f "$entry/deps" "$depfile" || exit 1; fi
write_key
exit 0
