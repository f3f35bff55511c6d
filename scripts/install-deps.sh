#!/usr/bin/env bash
# Installs everything the course needs on a fresh Debian 12 machine. Idempotent: a second
# run checks and returns in seconds. Called by the Makefile when something is missing.
#
#   scripts/install-deps.sh            # both LibTorch paths (what `make test` needs)
#   scripts/install-deps.sh primary    # PyPI torch 2.x in the course venv + Debian tools
#   scripts/install-deps.sh light      # Debian's libtorch-dev 1.13 + Debian tools
#   scripts/install-deps.sh venv       # only the venv, no Debian package (DTC_VENV and
#                                      # DTC_TORCH_VERSION choose where and which torch)
#
# The venv (several GB) lives outside the checkout, shared by every clone and by CI:
#   ${DTC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtc-course}/venv
# Times and sizes of each step are appended to $DTC_CACHE/install.log.
set -euo pipefail

what=${1:-all}
case "$what" in all|primary|light|base|venv) ;; *)
  echo "install-deps.sh: unknown argument '$what'. Use one of: all, primary, light, base, venv." >&2
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

apt_missing() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  echo "${missing[@]:-}"
}

apt_install() {
  local missing
  missing=$(apt_missing "$@")
  [ -z "$missing" ] && return 0
  echo "== apt: installing $missing"
  local t0=$SECONDS before after
  before=$(df --output=used -B1M / | tail -1)
  if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -mmin -1440 2>/dev/null | head -1)" ]; then
    $sudo_ apt-get update -q
  fi
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

[ "$what" = venv ] || apt_install "${base_pkgs[@]}"
case "$what" in
  venv) install_venv ;;
  all) apt_install "${primary_pkgs[@]}" "${light_pkgs[@]}"; install_venv ;;
  primary) apt_install "${primary_pkgs[@]}"; install_venv ;;
  light) apt_install "${light_pkgs[@]}" ;;
esac
echo "install-deps.sh: $what ready (log: $log)"
