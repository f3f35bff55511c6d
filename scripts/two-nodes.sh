#!/usr/bin/env bash
# Two "nodes" of NPROC ranks each (default 2) on this one machine, joined by torchrun's c10d
# rendezvous: a real multi-node launch, simulated with Linux network namespaces.
#
#   sudo scripts/two-nodes.sh build/bin/lesson04_solution            # any course program + args
#   sudo scripts/two-nodes.sh build/bin/lesson04 --json | tail -n 1  # rank 0's JSON
#
# Each node is a network namespace with its own interface, address and host name:
#
#   namespace  host name  interface  address        runs
#   <tag>n0    node0      veth0      10.77.0.1/24   torchrun ... --rdzv_conf is_host=1 (hosts the
#                                                   rendezvous store at node0:29400)
#   <tag>n1    node1      veth1      10.77.0.2/24   torchrun ... --rdzv_conf is_host=0
#
# veth0 and veth1 are the two ends of one virtual cable. Only addresses inside the namespaces
# this script creates are used; nothing outside them changes. What each step is for (lesson 04,
# README section 7):
#   - its own host name (unshare --uts; hostname nodeN) and a hosts file per namespace
#     (/etc/netns/<ns>/hosts, which `ip netns exec` mounts over /etc/hosts): torchrun's agent
#     publishes its host name as MASTER_ADDR; without them both nodes are called the same and
#     "node0" would resolve to the other node's own loopback, and the ranks hang;
#   - --rdzv_conf is_host=1 on node0: torchrun cannot tell inside a namespace that the endpoint
#     node0 is itself, so it is told;
#   - GLOO_SOCKET_IFNAME=vethN: gloo binds to the node's interface, not to 127.0.0.1;
#   - lo up: a fresh namespace's loopback is down, and the agent talks to its workers over it.
# The namespaces and hosts files are removed on exit, also on failure or Ctrl-C.
#
# Environment:
#   TORCHRUN  the torchrun command (default: the course venv's torchrun if present, else Debian's
#             `torchrun --redirects 2 --tee 2`, which 1.13 needs under Python 3.11)
#   NPROC     ranks per node (default 2)
#   TIMEOUT   seconds before a node is stopped (default 90)
#   NNODES    torchrun's --nnodes (default 2; 1:2 lets the job go on with one node)
#   LOSE_NODE1_WHEN  a path: once it exists, node1 is lost (every process in its namespace
#             killed, SIGKILL), and only node0's exit status counts (lesson 12: a file its
#             checkpoint commits, so that the loss comes after a save)
#   RDZV_CONF more of torchrun's --rdzv_conf, e.g. last_call_timeout=2 (how long a smaller
#             rendezvous waits for more nodes; 30 s by default)
# Exit status: 0 both nodes succeeded (node0, with LOSE_NODE1_WHEN); 1 a node failed (its log is
# printed); 2 bad usage;
# 77 network namespaces are not permitted here (not root, or a container without
# CAP_SYS_ADMIN): the reason is printed, and ctest reports the test as skipped.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/paths.sh"

usage() {
  echo "usage: sudo $0 PROGRAM [ARGS...]   e.g. sudo $0 build/bin/lesson04_solution --json" >&2
  exit 2
}
skip() {
  echo "two-nodes: SKIPPED: $1" >&2
  exit 77
}

[ $# -ge 1 ] || usage
case "$1" in -h | --help) sed -n '2,/^set -uo/p' "$0" | sed 's/^# \{0,1\}//;$d'; exit 0 ;; esac
program=$1
shift
[ -x "$program" ] || { echo "two-nodes: '$program' is not an executable program (build it first: make lesson04)" >&2; exit 2; }
program=$(cd "$(dirname "$program")" && pwd)/$(basename "$program")
nproc=${NPROC:-2}
timeout_s=${TIMEOUT:-90}
nnodes=${NNODES:-2}
lose_when=${LOSE_NODE1_WHEN:-}
rdzv_conf=${RDZV_CONF:-}
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || { echo "two-nodes: NPROC='$nproc' is not a positive number" >&2; exit 2; }
[[ "$timeout_s" =~ ^[1-9][0-9]*$ ]] || { echo "two-nodes: TIMEOUT='$timeout_s' is not a positive number" >&2; exit 2; }
if [ -z "${TORCHRUN:-}" ]; then
  if [ -x "$DTC_VENV/bin/torchrun" ]; then TORCHRUN="$DTC_VENV/bin/torchrun"; else TORCHRUN="torchrun --redirects 2 --tee 2"; fi
fi
read -r -a torchrun <<<"$TORCHRUN"
command -v "${torchrun[0]}" >/dev/null || { echo "two-nodes: torchrun not found: '${torchrun[0]}' (set TORCHRUN)" >&2; exit 2; }

# ---- can we make network namespaces here? ---------------------------------------------------
[ "$(id -u)" -eq 0 ] || skip "network namespaces need root: run it as sudo $0 $program $*"
for tool in ip unshare hostname timeout setsid; do
  command -v "$tool" >/dev/null || skip "'$tool' is not installed (Debian: iproute2, util-linux, coreutils)"
done

tag="dtc$$"  # unique per run: two runs side by side do not collide
nodes=("${tag}n0" "${tag}n1")
addrs=(10.77.0.1 10.77.0.2)
work=$(mktemp -d)
pids=()
made_etc_netns=0
[ -d /etc/netns ] || made_etc_netns=1

cleanup() {
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
  sleep 0.2
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
  for ns in "${nodes[@]}"; do
    ip netns del "$ns" 2>/dev/null
    rm -rf "/etc/netns/$ns"
  done
  [ "$made_etc_netns" -eq 0 ] || rmdir /etc/netns 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if ! err=$(ip netns add "${nodes[0]}" 2>&1); then
  skip "cannot create a network namespace ($err); a container needs CAP_SYS_ADMIN"
fi
ip netns add "${nodes[1]}" || exit 1

# ---- the two nodes and the cable between them -----------------------------------------------
ip link add veth0 netns "${nodes[0]}" type veth peer name veth1 netns "${nodes[1]}" || exit 1
for i in 0 1; do
  ns=${nodes[$i]}
  ip -n "$ns" addr add "${addrs[$i]}/24" dev "veth$i" || exit 1
  ip -n "$ns" link set "veth$i" up || exit 1
  ip -n "$ns" link set lo up || exit 1
  mkdir -p "/etc/netns/$ns"
  printf '127.0.0.1 localhost\n::1 localhost\n%s node0\n%s node1\n' "${addrs[0]}" "${addrs[1]}" >"/etc/netns/$ns/hosts"
done
echo "two-nodes: node0 = ${nodes[0]} (veth0 ${addrs[0]}), node1 = ${nodes[1]} (veth1 ${addrs[1]}); $nproc ranks each, ${torchrun[*]}" >&2

# ---- one torchrun per node ------------------------------------------------------------------
for i in 0 1; do
  is_host=$([ "$i" -eq 0 ] && echo 1 || echo 0)
  # setsid: each node is its own process group, so cleanup can stop all of it.
  setsid ip netns exec "${nodes[$i]}" unshare --uts sh -c 'hostname "$0" && exec "$@"' "node$i" \
    env GLOO_SOCKET_IFNAME="veth$i" \
    timeout --kill-after=5 "$timeout_s" "${torchrun[@]}" \
    --nnodes="$nnodes" --nproc_per_node="$nproc" \
    --rdzv_backend=c10d --rdzv_endpoint=node0:29400 --rdzv_id="$tag" --rdzv_conf "is_host=$is_host${rdzv_conf:+,$rdzv_conf}" \
    --no_python "$program" "$@" \
    >"$work/node$i.out" 2>"$work/node$i.err" &
  pids+=($!)
done

lost=0
if [ -n "$lose_when" ]; then  # node1 lost once the file exists (or node0 has ended)
  while [ ! -e "$lose_when" ] && kill -0 "${pids[0]}" 2>/dev/null; do sleep 0.2; done
  if [ -e "$lose_when" ]; then
    # Every process of node1's namespace (timeout puts torchrun in a process group of its own).
    ip netns pids "${nodes[1]}" | xargs -r kill -KILL 2>/dev/null
    lost=1
    echo "two-nodes: $lose_when exists: node1 lost (SIGKILL of every process in it)" >&2
  fi
fi
status=0
for i in 0 1; do
  wait "${pids[$i]}"
  rc[$i]=$?
  [ "$i" -eq 1 ] && [ "$lost" -eq 1 ] && continue
  [ "${rc[$i]}" -eq 0 ] || status=1
done
pids=()

# stderr: each node's log, prefixed; stdout: the programs' own output (rank 0's is last).
for i in 0 1; do
  sed "s/^/[node$i] /" "$work/node$i.err" >&2
  [ "$i" -eq 1 ] && [ "$lost" -eq 1 ] && continue
  [ "${rc[$i]}" -eq 0 ] || echo "two-nodes: node$i FAILED with exit status ${rc[$i]}$([ "${rc[$i]}" -eq 124 ] && echo " (timed out after ${timeout_s} s)")" >&2
done
cat "$work/node1.out" "$work/node0.out"
[ "$status" -eq 0 ] && echo "two-nodes: $([ "$lost" -eq 1 ] && echo "node0 finished alone" || echo "both nodes finished")" >&2
exit "$status"
