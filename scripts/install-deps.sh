#!/usr/bin/env bash
# Installs everything the course needs on a fresh Debian 12 machine. Idempotent: a second
# run checks and returns in seconds. Called by the Makefile when something is missing.
#
#   scripts/install-deps.sh            # both LibTorch paths (what `make test` needs)
#   scripts/install-deps.sh primary    # PyPI torch 2.x in the course venv + Debian tools
#   scripts/install-deps.sh light      # Debian's libtorch-dev 1.13 + Debian tools
#
# The venv (several GB) lives outside the checkout, shared by every clone and by CI:
#   ${DTC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtc-course}/venv
# Times and sizes of each step are appended to $DTC_CACHE/install.log.
set -euo pipefail

what=${1:-all}
case "$what" in all|primary|light|base) ;; *)
  echo "install-deps.sh: unknown argument '$what'. Use one of: all, primary, light, base." >&2
  exit 2 ;;
esac

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/paths.sh
source "$here/paths.sh"
mkdir -p "$DTC_CACHE"
log="$DTC_CACHE/install.log"

sudo_=""
if [ "$(id -u)" -ne 0 ]; then
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

install_venv() {
  if "$DTC_VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$DTC_TORCH_VERSION') else 1)" 2>/dev/null; then
    return 0
  fi
  echo "== pip: torch==$DTC_TORCH_VERSION into $DTC_VENV (several GB, once per machine)"
  local t0=$SECONDS
  /usr/bin/python3 -m venv "$DTC_VENV"
  "$DTC_VENV/bin/python" -m pip install -q --upgrade pip
  "$DTC_VENV/bin/python" -m pip install "torch==$DTC_TORCH_VERSION" numpy
  local size
  size=$(du -sm "$DTC_VENV" | cut -f1)
  echo "$(date -Is) venv [torch==$DTC_TORCH_VERSION]: $((SECONDS - t0)) s, $size MB on disk" | tee -a "$log"
}

apt_install "${base_pkgs[@]}"
case "$what" in
  all) apt_install "${primary_pkgs[@]}" "${light_pkgs[@]}"; install_venv ;;
  primary) apt_install "${primary_pkgs[@]}"; install_venv ;;
  light) apt_install "${light_pkgs[@]}" ;;
esac
echo "install-deps.sh: $what ready (log: $log)"
