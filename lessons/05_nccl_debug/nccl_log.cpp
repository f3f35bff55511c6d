// Lesson 05, given in full: the NCCL_DEBUG=INFO parser (contract: nccl_log.h). One regular
// expression per kind of line; the line formats are NCCL 2.x's (src/init.cc, src/graph/*.cc,
// src/transport.cc print them).
#include "nccl_log.h"

#include <fmt/format.h>

#include <algorithm>
#include <istream>
#include <ostream>
#include <regex>
#include <sstream>

namespace dtc::l05 {

NcclLogSummary parse_nccl_log(std::istream& in) {
  // "NCCL INFO NCCL version 2.21.5+cuda12.4"
  static const std::regex version_re(R"(NCCL version ([0-9][0-9.]*[0-9])(?:\+cuda([0-9.]+))?)");
  // "NCCL INFO comm 0x55d0c0a1b2c0 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0"
  static const std::regex comm_re(
      R"(comm (0x[0-9a-fA-F]+) rank (\d+) nRanks (\d+)(?: nNodes (\d+))?(?: localRanks (\d+))?)");
  // "NCCL INFO Channel 00/02 :    0   1   2   3"  (a ring: count, then the rank order)
  static const std::regex ring_re(R"(Channel (\d+)/(\d+) :((?:\s+\d+)+)\s*$)");
  // "NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read"
  static const std::regex conn_re(
      R"(Channel (\d+)/\d+ : (\d+)\[[0-9a-fx]+\] -> (\d+)\[[0-9a-fx]+\])"
      R"((?: \[(send|receive)\])?.* via (\S+))");
  // NCCL's own prefix "node0:3101:3170 [0] NCCL INFO" (after any launcher prefix): the host.
  static const std::regex host_re(R"(([^\s:\[\]]+):\d+:\d+ \[\d+\] $)");
  // "NCCL INFO Trees [0] 1/-1/-1->0->-1 [1] 1/-1/-1->0->-1"
  static const std::regex trees_re(R"(Trees((?: \[\d+\] \S+)+))");
  static const std::regex tree_item_re(R"(\[(\d+)\] (\S+))");
  // "NCCL INFO Using network IB" / "Using network Socket"
  static const std::regex network_re(R"(Using network (\S+))");

  NcclLogSummary s;
  std::string line;
  std::smatch m;
  while (std::getline(in, line)) {
    ++s.lines;
    const auto info = line.find("NCCL INFO ");
    const auto warn = line.find("NCCL WARN ");
    if (warn != std::string::npos) {
      ++s.nccl_lines;
      s.warnings.push_back(line.substr(warn + 10));
      continue;
    }
    if (info == std::string::npos) continue;
    ++s.nccl_lines;
    const std::string text = line.substr(info + 10);
    if (s.version.empty() && std::regex_search(text, m, version_re)) {
      s.version = m[1];
      s.cuda = m[2];
    } else if (std::regex_search(text, m, comm_re)) {
      const std::string id = m[1];
      auto it = std::find_if(s.comms.begin(), s.comms.end(),
                             [&](const NcclComm& c) { return c.id == id; });
      if (it == s.comms.end()) {
        s.comms.push_back({id,
                           std::stoi(m[3]),
                           m[4].matched ? std::stoi(m[4]) : 0,
                           m[5].matched ? std::stoi(m[5]) : 0,
                           {}});
        it = s.comms.end() - 1;
      }
      const int rank = std::stoi(m[2]);
      std::smatch h;
      const std::string prefix = line.substr(0, info);
      if (std::regex_search(prefix, h, host_re)) s.hosts.emplace(rank, h[1]);
      if (std::find(it->ranks_seen.begin(), it->ranks_seen.end(), rank) == it->ranks_seen.end()) {
        it->ranks_seen.push_back(rank);
        std::sort(it->ranks_seen.begin(), it->ranks_seen.end());
      }
    } else if (std::regex_search(text, m, conn_re)) {
      const std::string via = m[5];
      ++s.transports[via];
      // The family: "NET/IB/0" -> "NET/IB", "P2P/CUMEM/read" -> "P2P", "SHM/direct/direct" -> "SHM"
      std::string family = via.substr(0, via.find('/'));
      if (family == "NET") {
        const auto second = via.find('/', 4);
        family = via.substr(0, second);
      }
      ++s.transport_families[family];
      s.links.push_back({std::stoi(m[1]), std::stoi(m[2]), std::stoi(m[3]), m[4], via, family});
    } else if (std::regex_search(text, m, ring_re)) {
      const int channel = std::stoi(m[1]);
      s.channels = std::max(s.channels, std::stoi(m[2]));
      if (!s.rings.count(channel)) {
        std::vector<int> order;
        std::stringstream ranks(m[3].str());
        int r;
        while (ranks >> r) order.push_back(r);
        s.rings[channel] = order;
      }
    } else if (std::regex_search(text, m, trees_re)) {
      const std::string items = m[1];
      for (std::sregex_iterator it(items.begin(), items.end(), tree_item_re), end; it != end;
           ++it) {
        s.trees[std::stoi((*it)[1])].push_back((*it)[2]);
      }
    } else if (std::regex_search(text, m, network_re)) {
      s.network = m[1];
    }
  }
  return s;
}

void print_nccl_summary(std::ostream& out, const NcclLogSummary& s) {
  out << fmt::format(
      "NCCL {}{}   ({} of {} lines are NCCL's)\n",
      s.version.empty() ? "version: not in the log (NCCL_DEBUG=INFO set?)" : s.version,
      s.cuda.empty() ? "" : ", CUDA " + s.cuda, s.nccl_lines, s.lines);
  if (!s.network.empty()) out << "network plugin: " << s.network << "\n";
  for (const auto& c : s.comms) {
    out << fmt::format("comm {}: {} ranks on {} node(s), {} per node; init logged by {} rank(s)\n",
                       c.id, c.nranks, c.nnodes, c.local_ranks, c.ranks_seen.size());
  }
  out << fmt::format("channels: {}\n", s.channels);
  for (const auto& [ch, order] : s.rings) {
    std::string text;
    for (int r : order) text += std::to_string(r) + " -> ";
    out << fmt::format("  ring  {:02d}: {}{}\n", ch, text,
                       order.empty() ? "" : std::to_string(order[0]));
  }
  for (const auto& [ch, items] : s.trees) {
    std::string text;
    for (const auto& t : items) text += " " + t;
    out << fmt::format("  trees {:02d}:{}   (children/parent as down1/down2/down3->rank->up)\n", ch,
                       text);
  }
  out << "transports (connections):\n";
  for (const auto& [family, n] : s.transport_families)
    out << fmt::format("  {:<11} {}\n", family, n);
  for (const auto& [via, n] : s.transports) out << fmt::format("    via {:<20} {}\n", via, n);
  const bool single_node = !s.comms.empty() && s.comms[0].nnodes == 1;
  if (single_node &&
      s.transport_families.count("NET/Socket") + s.transport_families.count("NET/IB")) {
    out << "hint: ranks on one node talk over the network: is NCCL_P2P_DISABLE=1 and "
           "NCCL_SHM_DISABLE=1 set (a bisection left on)?\n";
  }
  for (const auto& w : s.warnings) out << "WARN: " << w << "\n";
}

}  // namespace dtc::l05
