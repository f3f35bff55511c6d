#!/usr/bin/env bash
# Proves the README's set-up on a truly fresh Debian 12 system: builds a minimal Debian 12 root
# with mmdebstrap (or debootstrap) from the Debian mirror this machine reaches, puts a clean clone
# of this repository's HEAD in it, and runs the README's two commands inside it, as a new user
# would. Not part of `make test` (it takes the better part of an hour and several GB).
#
#   sudo scripts/fresh-check.sh                     # make run, then make test
#   sudo scripts/fresh-check.sh --commands "make run" "make test-lesson06"
#   sudo scripts/fresh-check.sh --keep --out DIR    # keep the root for a look; logs in DIR
#
# Needs: root (chroot, mounts), mmdebstrap or debootstrap (`apt-get install mmdebstrap`),
# unshare from util-linux, git, about 15 GB free under --root, and the network this machine has
# (Debian's mirror, PyPI). The root is a "minbase" Debian 12 plus what a person needs to have
# cloned the course at all: git, make and ca-certificates. Nothing of this machine leaks in:
# the root has its own /usr, its own (empty) caches, and only what reaching the same registries
# takes is copied: DNS (/etc/resolv.conf), pip's settings (/etc/pip.conf, PIP_INDEX_URL and
# friends) and the machine's local certificate authorities (/usr/local/share/ca-certificates).
#
# Each step's time and status go to DIR/steps.tsv and DIR/summary.md; each step's output to
# DIR/NN-step.log. On the first failing step the check stops and prints that step's first error
# lines. Exit 0 when every step passed.
#
# Options:
#   --root DIR       where to build the root (default /var/tmp/dtc-fresh-root; emptied first)
#   --out DIR        logs and summary (default ./fresh-check)
#   --commands C...  the commands to run in the clone, in order (default: "make run" "make test")
#   --timeout S      per command, in seconds (default 5400)
#   --suite NAME     the Debian release (default bookworm)
#   --keep           keep the root afterwards (default: removed when every step passed)
#   --root-only      build the root and the clone, run nothing (for a look around)
#   --include PKGS   more Debian packages in the root, comma-separated (scripts/gpu-rehearsal.sh:
#                    the compiler, CMake and Python that a GPU node has, and nothing else)
#   --copy SRC:DEST  copy this machine's SRC into the root at DEST before the commands run
#                    (repeatable; scripts/gpu-rehearsal.sh carries the GPU bundle in this way)
set -uo pipefail

args=("$@")
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
root=/var/tmp/dtc-fresh-root
out=$PWD/fresh-check
suite=bookworm
timeout_s=5400
keep=0
root_only=0
include=git,make,ca-certificates
copies=()
commands=()

usage() { awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --root) root=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --suite) suite=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --root-only) root_only=1; shift ;;
    --include) include="$include,$2"; shift 2 ;;
    --copy) copies+=("$2"); shift 2 ;;
    --commands) shift; while [ $# -gt 0 ] && [[ $1 != --* ]]; do commands+=("$1"); shift; done ;;
    -h|--help) usage; exit 0 ;;
    *) echo "fresh-check: unknown argument '$1'" >&2
       echo "HINT: run '$0 --help' for the options" >&2; exit 2 ;;
  esac
done
[ ${#commands[@]} -gt 0 ] || commands=("make run" "make test")
root=$(realpath -m "$root")

die() { echo "fresh-check: $1" >&2; [ -n "${2:-}" ] && echo "HINT: $2" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || die "needs root (it builds a root file system and chroots into it)" \
  "run it as root or with sudo"
command -v unshare >/dev/null || die "unshare not found" "apt-get install util-linux"
if command -v mmdebstrap >/dev/null; then bootstrap=mmdebstrap
elif command -v debootstrap >/dev/null; then bootstrap=debootstrap
else die "neither mmdebstrap nor debootstrap is installed" "apt-get install mmdebstrap"; fi
case "$root" in /|/usr|/usr/*|/etc|/etc/*|/home|/root) die "refusing --root $root" \
  "give an empty or disposable folder, e.g. /var/tmp/dtc-fresh-root";; esac

# Everything below runs in a private mount namespace: the chroot's mounts vanish with this
# process, even when it is killed, and never show on the host.
if [ -z "${DTC_FRESH_NS:-}" ]; then
  DTC_FRESH_NS=1 exec unshare --mount --propagation private --fork "$0" "${args[@]}"
fi

mkdir -p "$out"
out=$(cd "$out" && pwd)
: > "$out/steps.tsv"
rm -f "$out/commit.txt"
rm -f "$out/steps.tsv.note"
step_no=0
first_failure=""

# step NAME TIMEOUT CMD...: runs CMD with a timeout, output to $out/NN-NAME.log, records time and
# status. Returns CMD's status.
step() {
  local name=$1 limit=$2
  shift 2
  step_no=$((step_no + 1))
  local log
  local slug=${name//[^A-Za-z0-9_.-]/_}
  log=$(printf '%s/%02d-%s.log' "$out" "$step_no" "${slug:0:60}")
  local t0=$SECONDS rc
  echo "== [$(date +%T)] $name"
  # The step's commands are this script's functions: run them in a child bash that has them.
  timeout --kill-after=30 "$limit" bash -c '"$@"' step "$@" > "$log" 2>&1
  rc=$?
  local dt=$((SECONDS - t0)) status=ok
  [ $rc -eq 0 ] || status="FAILED (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$dt" "$(basename "$log")" >> "$out/steps.tsv"
  echo "   $status in ${dt} s (log: $log)"
  if [ $rc -ne 0 ] && [ -z "$first_failure" ]; then
    first_failure=$name
    echo "---- first error lines of $name:"
    grep -n -m 15 -E 'error|Error|ERROR|FAILED|failed|No such file|not found' "$log" | head -15
    echo "---- last lines:"
    tail -n 15 "$log"
  fi
  return $rc
}

mounted=()
cleanup() {
  # Every process still running inside the root (a step's descendants outlive its timeout).
  local p r
  for p in /proc/[0-9]*; do
    r=$(readlink "$p/root" 2>/dev/null) || continue
    [ "$r" = "$root" ] && kill -9 "${p#/proc/}" 2>/dev/null
  done
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

summary() {
  {
    echo "# Fresh-system check"
    echo
    echo "Debian $suite root built with $bootstrap, $(nproc) cores, $(date -I); clean clone of"
    # The commit the clone took (HEAD may have moved on while the check ran).
    local commit
    commit=$(cat "$out/commit.txt" 2>/dev/null || git -C "$repo" log -1 --format='%h %s' HEAD)
    echo "\`$(echo "$commit" | cut -c1-90)\`."
    echo
    echo "| step | status | seconds |"
    echo "|---|---|---|"
    awk -F'\t' '{gsub(/\|/, "\\|", $1); printf "| `%s` | %s | %s |\n", $1, $2, $3}' "$out/steps.tsv"
    echo
    if [ -n "$first_failure" ]; then echo "First failure: **$first_failure**."; else echo "Every step passed."; fi
  } > "$out/summary.md"
  echo
  cat "$out/summary.md"
}

# 1. The root: minbase Debian, plus what cloning the course took (git, make, ca-certificates) and
# what --include adds.
make_root() {
  rm -rf "$root" && mkdir -p "$root"
  local mirror=http://deb.debian.org/debian
  if [ $bootstrap = mmdebstrap ]; then
    mmdebstrap --variant=minbase --include="$include" \
      "$suite" "$root" \
      "deb $mirror $suite main" "deb $mirror $suite-updates main" \
      "deb http://deb.debian.org/debian-security $suite-security main"
  else
    debootstrap --variant=minbase --include="$include" "$suite" "$root" "$mirror"
  fi
}

# 2. A clean clone of HEAD (what has been committed, nothing of this working tree's state).
clone() {
  mkdir -p "$root/root"
  git clone --no-local --quiet "$repo" "$root/root/course"
  git -C "$root/root/course" log -1 --format='%h %s' | tee "$out/commit.txt"
  cp -L /etc/resolv.conf "$root/etc/resolv.conf"
  # /etc/hosts, which the Debian installer writes on every machine and a bootstrapped root lacks:
  # without it, "localhost" does not resolve (torchrun's rendezvous uses it).
  # Nor this machine's name, which the root shares (torchrun --standalone meets at it): the
  # installer maps it to 127.0.1.1.
  [ -s "$root/etc/hosts" ] ||
    printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' \
      "$(hostname)" > "$root/etc/hosts"
  [ -f /etc/pip.conf ] && cp /etc/pip.conf "$root/etc/pip.conf"
  # This machine's own certificate authorities (a proxy's, say), which HTTPS to the registries
  # may need: what a new machine on the same network would be given.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    mkdir -p "$root/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates
  fi
  local c src dest
  while IFS= read -r c; do
    [ -n "$c" ] || continue
    src=${c%%:*} dest=${c#*:}
    mkdir -p "$root/$(dirname "$dest")" && cp -a "$src" "$root/$dest" || return 1
    echo "copied $src to $dest ($(du -sh "$src" | cut -f1))"
  done <<< "$copies_list"
  du -sh "$root"
}

# Mounts the chroot needs (in this script's own mount namespace, see above).
mount_root() {
  # The root must be a mount point of its own, as / is on a machine: `ip netns exec` (lesson 04's
  # two-node test) remounts / as a slave and fails on a plain folder.
  mount --bind "$root" "$root" && mounted+=("$root")
  mount -t proc proc "$root/proc" && mounted+=("$root/proc")
  mount --rbind /dev "$root/dev" && mount --make-rslave "$root/dev" && mounted+=("$root/dev")
  mount --rbind /sys "$root/sys" && mount --make-rslave "$root/sys" && mounted+=("$root/sys")
  mkdir -p "$root/dev/shm" && mount -t tmpfs -o size=4g tmpfs "$root/dev/shm" &&
    mounted+=("$root/dev/shm")
}

# The environment a new user's login shell would have: no variable of this machine's, except the
# registry settings (PIP_INDEX_URL and the like) needed to reach the same package registries.
in_root() {
  local envs=(HOME=/root USER=root LANG=C.UTF-8 TERM=dumb
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
  local v
  for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST PIP_CERT PIP_DEFAULT_TIMEOUT \
           http_proxy https_proxy no_proxy; do
    [ -n "${!v:-}" ] && envs+=("$v=${!v}")
  done
  chroot "$root" /usr/bin/env -i "${envs[@]}" /bin/bash -c "cd /root/course && $1"
}

copies_list=$(printf '%s\n' ${copies[@]+"${copies[@]}"})
export root out suite bootstrap repo include copies_list
export -f make_root clone in_root
step "root ($bootstrap, $suite minbase + $include)" 1800 make_root || { summary; exit 1; }
step "clean clone" 600 clone || { summary; exit 1; }
if [ $root_only -eq 0 ]; then
  if ! mount_root; then first_failure="mounts"; summary; exit 1; fi
  for c in "${commands[@]}"; do
    step "$c" "$timeout_s" in_root "$c" || break
  done
  # What the closing line of `make test` said, if it ran.
  grep -h -E '^test: [0-9]+ passed, [0-9]+ failed' "$out"/*.log 2>/dev/null | tail -1 |
    sed 's/^/closing line: /' | tee -a "$out/steps.tsv.note"
fi
summary
[ -f "$out/steps.tsv.note" ] && cat "$out/steps.tsv.note" >> "$out/summary.md"
if [ -n "$first_failure" ]; then
  echo "fresh-check: the root is kept for a look: chroot $root /bin/bash"
  exit 1
fi
if [ $keep -eq 0 ] && [ $root_only -eq 0 ]; then
  cleanup; mounted=()
  rm -rf "$root"
else
  echo "fresh-check: root kept in $root (chroot $root /bin/bash to look around)"
fi
