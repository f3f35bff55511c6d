# Sourced by the course's scripts: where the shared, per-user caches live.
# Override DTC_CACHE to move them (e.g. to a bigger disk).
: "${DTC_CACHE:=${XDG_CACHE_HOME:-$HOME/.cache}/dtc-course}"
: "${DTC_TORCH_VERSION:=2.15.0}"
: "${DTC_VENV:=$DTC_CACHE/venv}"
export DTC_CACHE DTC_TORCH_VERSION DTC_VENV
export CCACHE_DIR="${CCACHE_DIR:-$DTC_CACHE/ccache}"
