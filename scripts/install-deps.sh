#!/usr/bin/env bash
# Installs everything the course needs on a fresh Debian 12 machine. Idempotent: a second
# run checks and returns in seconds. Called by the Makefile when something is missing.
#
#   scripts/install-deps.sh            # both LibTorch paths and the tools (what `make test` needs)
#   scripts/install-deps.sh primary    # a learner's: PyPI torch 2.x in the course venv, the
#                                      # compilers and libraries (`make run`, `make test-lessonNN`)
#   scripts/install-deps.sh light      # Debian's libtorch-dev 1.13, the compilers and libraries
#   scripts/install-deps.sh tools      # the instructor's: slides, docs and lint (`make slides`,
#                                      # `make docs`, `make format`; `make test` checks them)
#   scripts/install-deps.sh venv       # only the venv, no Debian package (DTC_VENV and
#                                      # DTC_TORCH_VERSION choose where and which torch)
#
# The venv (several GB) lives outside the checkout, shared by every clone and by CI:
#   ${DTC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtc-course}/venv
# Times and sizes of each step are appended to $DTC_CACHE/install.log.
set -euo pipefail

what=${1:-all}
case "$what" in all|primary|light|tools|base|venv) ;; *)
  echo "install-deps.sh: unknown argument '$what'. Use one of: all, primary, light, tools, base, venv." >&2
  exit 2 ;;
esac

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/paths.sh
source "$here/paths.sh"
mkdir -p "$DTC_CACHE"
log="$DTC_CACHE/install.log"

sudo_=""
if [ "$what" != venv ] && [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then sudo_="sudo"; else
    echo "install-deps.sh: need root or sudo to install Debian packages." >&2
    echo "HINT: run it as root, or install the packages listed in scripts/packages.txt by hand." >&2
    exit 1
  fi
fi

# The package lists live in one place, scripts/packages.txt ("GROUP: pkg pkg ...").
packages_of() {
  sed -n "s/^$1:[[:space:]]*//p" "$here/packages.txt" | tr -s ' \n' ' '
}
read -r -a base_pkgs <<<"$(packages_of base)"
read -r -a primary_pkgs <<<"$(packages_of primary)"
read -r -a light_pkgs <<<"$(packages_of light)"
read -r -a tools_pkgs <<<"$(packages_of tools)"

apt_missing() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  echo "${missing[@]:-}"
}

# apt_install WHAT PKG...: installs the missing ones, saying first what they are for and what
# they take (apt's own estimate: download and disk).
apt_install() {
  local what=$1 missing
  shift
  missing=$(apt_missing "$@")
  [ -z "$missing" ] && return 0
  echo "== apt: installing $what: $missing"
  local t0=$SECONDS before after
  before=$(df --output=used -B1M / | tail -1)
  if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -mmin -1440 2>/dev/null | head -1)" ]; then
    $sudo_ apt-get update -q
  fi
  # shellcheck disable=SC2086
  $sudo_ apt-get install -s --no-install-recommends $missing 2>/dev/null |
    awk '/^Inst /{n++} END {printf "   %d Debian packages with what they need", n}' || true
  # shellcheck disable=SC2086
  $sudo_ apt-get install --assume-no --no-install-recommends $missing 2>/dev/null |
    sed -n 's/^Need to get \([^ ]* [^ ]*\).*/: \1 to download/p; s/^After this operation, \([^ ]* [^ ]*\) of additional.*/, \1 on disk/p' |
    tr -d '\n' || true
  echo
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -q --no-install-recommends $missing
  after=$(df --output=used -B1M / | tail -1)
  echo "$(date -Is) apt [$missing]: $((SECONDS - t0)) s, +$((after - before)) MB on disk" | tee -a "$log"
}

# The torch wheel is a CUDA build. Compiling against it needs the CUDA runtime's headers, which
# the wheel's nvidia-cuda-runtime brings, except the few nvcc keeps (crt/host_config.h, in
# nvidia-cuda-crt, 130 kB; and CCCL's, in nvidia-cuda-cccl): without a CUDA toolkit on the
# machine, those come from PyPI too, at the runtime's own major.minor version
# (cmake/DtcTorch.cmake then describes the runtime from the wheel).
venv_ready() {
  "$DTC_VENV/bin/python" - "$DTC_TORCH_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as m, pathlib, sys, torch
assert torch.__version__.startswith(sys.argv[1])
try:
    m.version("nvidia-cuda-runtime")
except m.PackageNotFoundError:
    sys.exit(0)  # a CPU build: nothing more to compile against
m.version("nvidia-cuda-crt")
m.version("nvidia-cuda-cccl")
PY
}

install_venv() {
  venv_ready && return 0
  echo "== pip: torch==$DTC_TORCH_VERSION into $DTC_VENV (several GB, once per machine)"
  local t0=$SECONDS
  /usr/bin/python3 -m venv "$DTC_VENV"
  "$DTC_VENV/bin/python" -m pip install -q --upgrade pip
  "$DTC_VENV/bin/python" -m pip install "torch==$DTC_TORCH_VERSION" numpy
  local cudart
  cudart=$("$DTC_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("nvidia-cuda-runtime"))' 2>/dev/null || true)
  if [ -n "$cudart" ]; then
    # The same major.minor: their patch releases do not follow the runtime's one for one (torch
    # 2.11's runtime 13.0.96 has no crt 13.0.96; 13.0.88 has the same headers). CCCL (nv/target,
    # which cuda_fp16.h includes) comes with torch 2.15's wheel, not with 2.11's.
    local pkg
    for pkg in nvidia-cuda-crt nvidia-cuda-cccl; do
      "$DTC_VENV/bin/python" -c "import importlib.metadata as m; m.version('$pkg')" 2>/dev/null ||
        "$DTC_VENV/bin/python" -m pip install "$pkg==$(cut -d. -f1,2 <<< "$cudart").*"
    done
  fi
  local size
  size=$(du -sm "$DTC_VENV" | cut -f1)
  echo "$(date -Is) venv [torch==$DTC_TORCH_VERSION]: $((SECONDS - t0)) s, $size MB on disk" | tee -a "$log"
}

case "$what" in venv|tools) ;; *) apt_install "compilers, CMake and the course's libraries" "${base_pkgs[@]}" ;; esac
case "$what" in
  venv) install_venv ;;
  all) apt_install "both LibTorch paths' own" "${primary_pkgs[@]}" "${light_pkgs[@]}"
       apt_install "the slide, docs and lint tools" "${tools_pkgs[@]}"; install_venv ;;
  primary) apt_install "the primary path's own" "${primary_pkgs[@]}"; install_venv ;;
  light) apt_install "the light path (Debian's LibTorch 1.13)" "${light_pkgs[@]}" ;;
  tools) apt_install "the slide, docs and lint tools (make slides, make docs, make format)" \
           "${tools_pkgs[@]}" ;;
esac
echo "install-deps.sh: $what ready (log: $log)"
