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
  std::string via;          ///< the connection's full transport, e.g. "NET/IB/0/GDRDMA"
  std::string family;       ///< "P2P", "SHM", "NET/IB", "NET/Socket" (NcclLink::family)
  bool gpu_direct = false;  ///< a network connection with GPUDirect RDMA ("/GDRDMA" in via)
  bool same_node = false;   ///< both ranks on one host (NcclLogSummary::hosts)
};

/// What explain_link() concludes.
struct LinkDiagnosis {
  /// The transport is the one NCCL takes when nothing is in its way (P2P inside a node; GPUDirect
  /// RDMA over IB between nodes; P2P across nodes is multi-node NVLink).
  bool healthy = false;
  /// The variables set in the environment that forced this transport, in the order of the rules
  /// below (empty when healthy, and when nothing in the environment explains it).
  std::vector<std::string> variables;
  std::string why;  ///< one sentence for a person: what NCCL did, and what to look at
};

/// The connection @p from -> @p to in @p log (TODO(L05)).
///
/// Network connections are logged twice, by the sender ("[send]") and the receiver
/// ("[receive]"), and a ring's connections once per channel: any of those lines is the link
/// (they agree). same_node is true when both ranks' hosts are known and equal.
/// @return std::nullopt when the log has no connection from @p from to @p to (the reverse
///   direction does not count: NCCL connects each direction separately).
/// @throws std::invalid_argument when the link exists but a rank's host is not in the log
///   (the log lacks the "host:pid:tid [dev] NCCL INFO comm ... rank R" line of that rank).
std::optional<LinkReading> read_link(const NcclLogSummary& log, int from, int to);

/// Why NCCL chose this link's transport, given the environment the job ran with (TODO(L05)).
///
/// NCCL takes, inside a node, P2P, else SHM, else the network; between nodes, NET/IB (with
/// GPUDirect RDMA where the NIC and the GPU allow it), else NET/Socket. A variable "forces" a
/// step down when it is set as follows (NCCL's environment variables page):
///   P2P disabled:      NCCL_P2P_DISABLE=1, or NCCL_P2P_LEVEL=LOC (or its number, 0)
///   SHM disabled:      NCCL_SHM_DISABLE=1
///   IB disabled:       NCCL_IB_DISABLE=1, or NCCL_NET=Socket
///   GPUDirect RDMA:    NCCL_NET_GDR_LEVEL=LOC (or 0)
/// The rules:
///   same node, P2P:             healthy.
///   same node, SHM:             P2P was not used: the P2P variables set are the reason; with
///                               none set, healthy (GPUs without a direct path: NCCL's fallback).
///   same node, network:         unhealthy: the P2P and then the SHM variables set; with none
///                               set, no variables (P2P and SHM both failed: a container without
///                               --ipc=host, a small /dev/shm).
///   across nodes, P2P:          healthy (multi-node NVLink).
///   across nodes, NET/IB:       healthy with GPUDirect RDMA; without it unhealthy, with the
///                               GPUDirect variable if set (else: nvidia-peermem, or the NIC too
///                               far from the GPU).
///   across nodes, NET/Socket:   unhealthy: the IB variables set (else no usable IB/RoCE device).
/// @throws std::invalid_argument for SHM across nodes (shared memory cannot cross hosts: the
///   log's hosts are wrong) and for a family not in the list above.
LinkDiagnosis explain_link(const LinkReading& link, const EnvLookup& env);

/// The interfaces NCCL's socket code takes (ncclFindInterfaces), in the machine's order
/// (TODO(L05)).
///
/// @param socket_ifname NCCL_SOCKET_IFNAME's value; std::nullopt when unset. NCCL ignores a
///   value shorter than 2 characters (as if unset).
/// @param interfaces the names of the machine's interfaces that are up and have an address, in
///   the order the system lists them (`ip -br addr`, getifaddrs()).
/// Set: a comma-separated list of name prefixes; a leading '^' makes it a list to exclude, and a
///   '=' (after the '^', if any) makes its entries exact names ("^=docker0").
/// Unset: the first of these that selects anything: "ib"; "^docker,lo,virbr"; "docker"; "lo";
///   "virbr" (NCCL also tries NCCL_COMM_ID's subnet after "ib"; not modelled here).
/// @return the selected names, in the order of @p interfaces; empty when nothing matches (NCCL
///   then fails: "no socket interface found"). The bootstrap uses the first.
std::vector<std::string> nccl_pick_interfaces(const std::optional<std::string>& socket_ifname,
                                              const std::vector<std::string>& interfaces);

/// Does NCCL_SOCKET_IFNAME in @p env make NCCL use @p cluster_interface, the interface the nodes
/// reach each other on, and only it (TODO(L05))?
/// @return std::nullopt when NCCL picks exactly {cluster_interface}. Otherwise a diagnosis with
///   variables {"NCCL_SOCKET_IFNAME"} and a why that names what NCCL picks (or that it picks
///   nothing) and the fix, NCCL_SOCKET_IFNAME==<cluster_interface>, an exact name.
/// @throws std::invalid_argument when @p cluster_interface is not in @p interfaces.
std::optional<LinkDiagnosis> check_socket_ifname(const EnvLookup& env,
                                                 const std::vector<std::string>& interfaces,
                                                 const std::string& cluster_interface);

}  // namespace dtc::l05
