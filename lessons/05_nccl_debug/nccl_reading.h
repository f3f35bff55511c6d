// Lesson 05, the contract of your second part: reading what NCCL did and why.
//
//   1. read_link() and explain_link(): from an NCCL_DEBUG=INFO log (parsed by the given
//      parse_nccl_log()), the transport between two ranks, and the variables of the environment
//      that made NCCL choose it (README section 9).
//   2. nccl_pick_interfaces() and check_socket_ifname(): which network interfaces NCCL's socket
//      code takes for a value of NCCL_SOCKET_IFNAME on a machine's interfaces, and whether that is
//      the network the nodes reach each other on (README section 2).
//
// You write the four functions marked TODO(L05) in nccl_reading.cpp.
//   make test-lesson05                 # tests/lesson05/nccl_reading_test.cpp (L05Reading.*)
//   build/bin/lesson05 nccl-log run.log --link 0 1     # your read_link() and explain_link()
//   build/bin/lesson05 interfaces --cluster eth0       # your check_socket_ifname()
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "dtc/launch.h"
#include "nccl_log.h"

namespace dtc::l05 {

/// The connection from one rank to another, as a log reports it.
struct LinkReading {
  int from = 0;
  int to = 0;
  std::string via;          ///< the first line's transport, e.g. "NET/IB/0/GDRDMA"
  std::string family;       ///< "P2P", "SHM", "NET/IB", "NET/Socket", ... (NcclLink::family)
  bool gpu_direct = false;  ///< a network connection with GPUDirect RDMA on either side
  bool same_node = false;   ///< both ranks on one host (NcclLogSummary::hosts)
};

/// What explain_link() and check_socket_ifname() conclude.
struct LinkDiagnosis {
  /// Nothing to fix: the transport is the one NCCL takes when nothing is in its way, or the
  /// one the hardware leaves it (see the rules). check_socket_ifname() never sets it.
  bool healthy = false;
  /// The variables set in the environment that forced this transport, in the order of the rules
  /// below (empty when healthy, and when nothing in the environment explains it).
  std::vector<std::string> variables;
  std::string why;  ///< one sentence for a person: what NCCL did, and what to look at
};

/// The connection @p from -> @p to in @p log, a log of one communicator (TODO(L05)).
///
/// A ring's connections are logged once per channel, and network connections twice, by the
/// sender ("[send]") and the receiver ("[receive]"). Those lines need not agree on the details:
/// each side names its own NIC, and GPUDirect RDMA is decided per side (the sender reads GPU
/// memory directly only where NCCL_NET_GDR_READ allows it, by default from Ampere on). So `via`
/// and `family` are the first line's, and gpu_direct is true when any line of the link shows
/// "/GDRDMA".
/// @return std::nullopt when the log has no connection from @p from to @p to (the reverse
///   direction does not count: NCCL connects each direction separately).
/// @throws std::invalid_argument when the link exists but either rank's host is not in the log
///   (the log lacks the "host:pid:tid [dev] NCCL INFO comm ... rank R" line of that rank);
///   otherwise same_node compares the two hosts.
std::optional<LinkReading> read_link(const NcclLogSummary& log, int from, int to);

/// Why NCCL chose this link's transport, given the environment the job ran with (TODO(L05)).
///
/// NCCL tries, for each peer, P2P, then SHM, then the network (src/transport.cc); between nodes
/// only the network, IB before sockets, with GPUDirect RDMA where the NIC and the GPU allow it.
/// A variable counts when it is set as follows (NCCL's environment variables page; numbers as
/// NCCL parses them, so "1" and "01" are the same):
///   P2P off:   NCCL_P2P_DISABLE not 0; else NCCL_P2P_LEVEL anything but SYS (or its legacy
///              numbers 4, 5): LOC (0) never uses P2P, and NVL, PIX, PXB, PHB (1-3) forbid it
///              for GPUs farther apart than that (NVL: every pair without NVLink). NCCL reads
///              the level only when P2P is not disabled, so the two are never both named.
///   SHM off:   NCCL_SHM_DISABLE not 0.
///   IB off:    NCCL_IB_DISABLE not 0, or NCCL_NET=Socket (any case: NCCL compares it so).
///   GDR off:   NCCL_NET_GDR_LEVEL=LOC (or 0).
/// The rules:
///   same node, P2P:          healthy.
///   same node, SHM:          P2P was not used: the P2P variable set is the reason; with none
///                            set, healthy (no direct path between these GPUs: NCCL's fallback).
///   same node, network:      not healthy: the P2P variable, then NCCL_SHM_DISABLE, if set; with
///                            neither set, no variables (P2P and SHM were impossible, as between
///                            containers without a shared IPC namespace, or NCCL preferred the
///                            NIC: NCCL_NET_DISABLE_INTRA=1 forbids that).
///   across nodes, P2P:       healthy (multi-node NVLink).
///   across nodes, NET/IB:    healthy with GPUDirect RDMA; without it, not healthy when the GDR
///                            variable is set (it is the reason), else healthy (the NIC is too
///                            far from the GPU, or nvidia-peermem is not loaded: say so in why).
///   across nodes, NET/Socket: not healthy: the IB variables set (else no usable IB/RoCE device).
///   across nodes, another NET/* (a network plugin: NET/IBext, AWS's libfabric): healthy.
/// @throws std::invalid_argument for SHM across nodes (shared memory cannot cross hosts: the
///   log's hosts are wrong) and for a family that is none of P2P, SHM, NET/*.
LinkDiagnosis explain_link(const LinkReading& link, const EnvLookup& env);

/// The interfaces NCCL's socket code takes (ncclFindInterfaces), in the machine's order
/// (TODO(L05)).
///
/// @param socket_ifname NCCL_SOCKET_IFNAME's value; std::nullopt when unset. NCCL ignores a
///   value shorter than 2 characters (as if unset).
/// @param interfaces the names of the machine's interfaces that NCCL considers, in its order:
///   those running with an IPv4 or IPv6 address (not the IPv6 loopback), in getifaddrs() order,
///   IPv4 ones first (`ip -br addr` also lists interfaces that are down or have no address).
/// Set: a comma-separated list of name prefixes; a leading '^' makes it a list to exclude, and a
///   '=' (after the '^', if any) makes its entries exact names ("^=docker0").
/// Unset: the first of these that selects anything: "ib"; "^docker,lo,virbr"; "docker"; "lo";
///   "virbr" (NCCL 2.28 and later; up to 2.27, "ib", "^docker,lo", "docker", "lo", so virbr0 is
///   taken with the rest). NCCL also tries NCCL_COMM_ID's subnet after "ib"; not modelled here,
///   nor an entry's ":port" suffix, nor an empty entry list ("=" alone).
/// @return the selected names, in the order of @p interfaces; empty when nothing matches (NCCL
///   then fails: "no socket interface found"). The bootstrap uses the first.
std::vector<std::string> nccl_pick_interfaces(const std::optional<std::string>& socket_ifname,
                                              const std::vector<std::string>& interfaces);

/// Does NCCL_SOCKET_IFNAME in @p env make NCCL use @p cluster_interface, the interface the nodes
/// reach each other on, and only it (TODO(L05))?
/// @return std::nullopt when NCCL picks exactly {cluster_interface}. Otherwise a diagnosis with
///   variables {"NCCL_SOCKET_IFNAME"} and a why that names what NCCL picks (or that it picks
///   nothing) and the fix, NCCL_SOCKET_IFNAME==<cluster_interface> (the value =<cluster_interface>:
///   an exact name).
/// @throws std::invalid_argument when @p cluster_interface is not in @p interfaces.
std::optional<LinkDiagnosis> check_socket_ifname(const EnvLookup& env,
                                                 const std::vector<std::string>& interfaces,
                                                 const std::string& cluster_interface);

}  // namespace dtc::l05
