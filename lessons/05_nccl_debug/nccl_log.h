// Lesson 05, given in full: reading NCCL_DEBUG=INFO output.
//   NCCL_DEBUG=INFO torchrun ... 2> run.log ; build/bin/lesson05 nccl-log run.log
// The parser extracts what you look for first in a log: the NCCL version, each communicator's
// ranks and nodes, channels, the ring order and the trees, the transport between every pair of
// ranks (P2P, SHM, NET/IB, NET/Socket), the network plugin, and the WARN lines.
// tests/lesson05/given_test.cpp (suite L05NcclLogGiven) checks it on the samples in
// tests/lesson05/data/.
#pragma once

#include <iosfwd>
#include <map>
#include <string>
#include <vector>

namespace dtc::l05 {

/// One communicator seen in the log ("comm 0x... rank R nRanks N nNodes M localRanks L ...").
struct NcclComm {
  std::string id;               ///< "0x55d0c0a1b2c0"
  int nranks = 0;               ///< nRanks
  int nnodes = 0;               ///< nNodes (0 when the line does not say)
  int local_ranks = 0;          ///< localRanks (0 when the line does not say)
  std::vector<int> ranks_seen;  ///< ranks that logged this comm's init line, ascending
};

/// One connection line: "Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA".
struct NcclLink {
  int channel = 0;     ///< 0 for "Channel 00/0"
  int from = 0;        ///< the sending rank (1 above)
  int to = 0;          ///< the receiving rank (2 above)
  std::string side;    ///< "send", "receive" (network connections log both ends), "" otherwise
  std::string via;     ///< "NET/IB/0/GDRDMA", "P2P/CUMEM/read", "SHM/direct/direct", ...
  std::string family;  ///< "NET/IB", "NET/Socket", "P2P", "SHM": via up to its transport's name
};

/// A summary of an NCCL_DEBUG=INFO log.
struct NcclLogSummary {
  std::string version;  ///< "2.21.5" (from "NCCL version 2.21.5+cuda12.4")
  std::string cuda;     ///< "12.4" ("" when absent)
  std::string network;  ///< "IB", "Socket" ("Using network X"), "" when absent
  std::vector<NcclComm> comms;
  int channels = 0;  ///< the number of ring channels ("Channel 00/02 :" -> 2), max over lines
  /// Ring order per channel, as rank 0 logged it ("Channel 00/02 :    0   1   2   3").
  std::map<int, std::vector<int>> rings;
  /// Tree lines per channel: "1/-1/-1->0->-1" (children/parent as NCCL prints them).
  std::map<int, std::vector<std::string>> trees;
  /// Transport name -> number of connections logged ("P2P/CUMEM/read", "SHM/direct/direct",
  /// "NET/IB/0", "NET/Socket/0", ...), from "Channel 00/0 : 0[0] -> 1[1] via X".
  std::map<std::string, int> transports;
  /// Transport family ("P2P", "SHM", "NET/IB", "NET/Socket", ...) -> connections.
  std::map<std::string, int> transport_families;
  std::vector<NcclLink> links;  ///< every connection line, in the log's order
  /// Rank -> host, from the "host:pid:tid [dev]" prefix of the rank's "comm ... rank R" line
  /// (ranks whose line has no such prefix are absent).
  std::map<int, std::string> hosts;
  std::vector<std::string> warnings;  ///< the text after "NCCL WARN"
  int lines = 0;                      ///< lines read
  int nccl_lines = 0;                 ///< lines with "NCCL INFO" or "NCCL WARN"
};

/// Parses an NCCL_DEBUG=INFO log (any prefix before "NCCL INFO", e.g. torchrun's "[rank0]:" or
/// "host:pid:tid [dev]", is ignored).
NcclLogSummary parse_nccl_log(std::istream& in);

/// Prints @p summary for a human: version, communicators, channels, rings, trees, transports,
/// and hints (e.g. NET/Socket between ranks on one node means P2P and SHM are both disabled).
void print_nccl_summary(std::ostream& out, const NcclLogSummary& summary);

}  // namespace dtc::l05
