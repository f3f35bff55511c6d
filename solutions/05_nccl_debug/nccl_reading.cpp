// Lesson 05, your second part: reading what NCCL did, and why (contract: nccl_reading.h).
//   make test-lesson05
// The log is parsed for you (parse_nccl_log(): links, hosts); here you decide what it means.
#include "nccl_reading.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <stdexcept>

#include "dtc/todo.h"

namespace dtc::l05 {
namespace {

// (maybe_unused: the untouched exercise does not call these helpers yet.)
// Whether env sets name to one of values, compared without regard to case.
[[maybe_unused]] bool set_to(const EnvLookup& env, const std::string& name,
                             std::initializer_list<const char*> values) {
  const auto v = env(name);
  if (!v) return false;
  return std::any_of(values.begin(), values.end(), [&](const char* x) {
    const std::string w = x;
    return v->size() == w.size() && std::equal(v->begin(), v->end(), w.begin(), [](char c, char d) {
             return std::tolower(static_cast<unsigned char>(c)) ==
                    std::tolower(static_cast<unsigned char>(d));
           });
  });
}

// An integer variable as NCCL reads it (strtoll): set, a number, and not 0.
[[maybe_unused]] bool nonzero(const EnvLookup& env, const std::string& name) {
  const auto v = env(name);
  if (!v || v->empty()) return false;
  char* end = nullptr;
  const long long n = std::strtoll(v->c_str(), &end, 0);
  return end != v->c_str() && n != 0;
}

[[maybe_unused]] bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

[[maybe_unused]] std::string join(const std::vector<std::string>& items) {
  return fmt::format("{}", fmt::join(items, ", "));
}

}  // namespace

std::optional<LinkReading> read_link(const NcclLogSummary& log, int from, int to) {
  // BEGIN SOLUTION: the first connection line from -> to (either end's), its family, GPUDirect
  //   RDMA on any of its lines, and same_node from both ranks' hosts; nullopt when there is none,
  //   and std::invalid_argument when a rank's host is unknown (L05Reading.ReadLink*; README section
  //   9)
  const auto it = std::find_if(log.links.begin(), log.links.end(),
                               [&](const NcclLink& l) { return l.from == from && l.to == to; });
  if (it == log.links.end()) return std::nullopt;
  const auto a = log.hosts.find(from), b = log.hosts.find(to);
  if (a == log.hosts.end() || b == log.hosts.end()) {
    throw std::invalid_argument(
        fmt::format("the log has no host for rank {}: is its 'comm ... rank {}' line (with NCCL's "
                    "host:pid:tid prefix) in the file?",
                    a == log.hosts.end() ? from : to, a == log.hosts.end() ? from : to));
  }
  LinkReading r;
  r.from = from;
  r.to = to;
  r.via = it->via;
  r.family = it->family;
  r.gpu_direct = std::any_of(log.links.begin(), log.links.end(), [&](const NcclLink& l) {
    return l.from == from && l.to == to && starts_with(l.via, "NET/") &&
           l.via.find("/GDRDMA") != std::string::npos;
  });
  r.same_node = a->second == b->second;
  return r;
  // END SOLUTION
}

LinkDiagnosis explain_link(const LinkReading& link, const EnvLookup& env) {
  // BEGIN SOLUTION: apply the contract's rules: the expected transport is healthy; otherwise
  //   name the variables set that forced each step down, in the rules' order
  //   (L05Reading.Explain*; README section 9)
  std::vector<std::string> p2p_off;  // at most one: NCCL reads the level only without DISABLE
  if (nonzero(env, "NCCL_P2P_DISABLE")) {
    p2p_off.push_back("NCCL_P2P_DISABLE");
  } else if (env("NCCL_P2P_LEVEL") && !set_to(env, "NCCL_P2P_LEVEL", {"SYS", "4", "5"})) {
    p2p_off.push_back("NCCL_P2P_LEVEL");
  }
  const bool shm_off = nonzero(env, "NCCL_SHM_DISABLE");
  LinkDiagnosis d;
  const std::string& f = link.family;
  const bool net = starts_with(f, "NET/");
  if (f != "P2P" && f != "SHM" && !net) {
    throw std::invalid_argument("unknown transport family '" + f +
                                "': expected P2P, SHM or NET/<network>");
  }
  if (link.same_node) {
    if (f == "P2P") {
      d.healthy = true;
      d.why = "P2P inside a node: what NCCL takes when nothing is in its way";
    } else if (f == "SHM") {
      d.variables = p2p_off;
      d.healthy = p2p_off.empty();
      d.why = p2p_off.empty() ? "SHM through host memory: these GPUs have no direct path (no "
                                "NVLink, P2P not supported across their PCIe roots); "
                                "`nvidia-smi topo -m` shows the path"
                              : "SHM because P2P is disabled by " + join(p2p_off) +
                                    ": unset it once the bisection is over";
    } else {
      d.variables = p2p_off;
      if (shm_off) d.variables.push_back("NCCL_SHM_DISABLE");
      d.why = d.variables.empty()
                  ? "the network between ranks of one node, with nothing set against P2P or SHM: "
                    "they were impossible (ranks in containers without a shared IPC namespace: "
                    "--ipc=host), or NCCL preferred the NIC (NCCL_NET_DISABLE_INTRA=1 forbids it)"
                  : "the network between ranks of one node, because " + join(d.variables) +
                        (d.variables.size() > 1 ? " are" : " is") + " set: unset them";
    }
    return d;
  }
  if (f == "SHM") {
    throw std::invalid_argument(fmt::format(
        "SHM between ranks {} and {} on different hosts: shared memory cannot cross hosts; the "
        "log's hosts are wrong",
        link.from, link.to));
  }
  if (f == "P2P" || (f == "NET/IB" && link.gpu_direct)) {
    d.healthy = true;
    d.why = f == "P2P" ? "P2P across nodes: multi-node NVLink"
                       : "InfiniBand with GPUDirect RDMA between nodes: the fast path";
  } else if (f == "NET/IB") {
    if (set_to(env, "NCCL_NET_GDR_LEVEL", {"LOC", "0"}))
      d.variables.push_back("NCCL_NET_GDR_LEVEL");
    d.healthy = d.variables.empty();
    d.why = d.healthy ? "InfiniBand without GPUDirect RDMA: the NIC is too far from the GPU, or "
                        "nvidia-peermem is not loaded (`lsmod | grep peermem`)"
                      : "InfiniBand without GPUDirect RDMA, because NCCL_NET_GDR_LEVEL forbids it";
  } else if (f == "NET/Socket") {
    if (nonzero(env, "NCCL_IB_DISABLE")) d.variables.push_back("NCCL_IB_DISABLE");
    if (set_to(env, "NCCL_NET", {"Socket"})) d.variables.push_back("NCCL_NET");
    d.why = d.variables.empty()
                ? "sockets between nodes: NCCL found no usable IB/RoCE device (look for "
                  "'NET/IB : No device found', and NCCL_IB_HCA)"
                : "sockets between nodes, because " + join(d.variables) + " chose them";
  } else {
    d.healthy = true;
    d.why = "a network plugin (" + f + ") between nodes";
  }
  return d;
  // END SOLUTION
}

std::vector<std::string> nccl_pick_interfaces(const std::optional<std::string>& socket_ifname,
                                              const std::vector<std::string>& interfaces) {
  // BEGIN SOLUTION: NCCL's rules in the contract: a set value (2 characters or more) is a
  //   prefix list, '^' excludes, '=' makes names exact; unset tries "ib", "^docker,lo,virbr",
  //   "docker", "lo", "virbr" in turn (L05Reading.PickInterfaces*; README section 9)
  const auto filter = [&](std::string spec) {
    const bool exclude = !spec.empty() && spec[0] == '^';
    if (exclude) spec.erase(0, 1);
    const bool exact = !spec.empty() && spec[0] == '=';
    if (exact) spec.erase(0, 1);
    std::vector<std::string> entries;
    for (std::size_t start = 0; start <= spec.size();) {
      const auto comma = std::min(spec.find(',', start), spec.size());
      if (comma > start) entries.push_back(spec.substr(start, comma - start));
      start = comma + 1;
    }
    std::vector<std::string> out;
    for (const auto& name : interfaces) {
      const bool match = std::any_of(entries.begin(), entries.end(), [&](const std::string& e) {
        return exact ? name == e : starts_with(name, e);
      });
      if (match != exclude) out.push_back(name);
    }
    return out;
  };
  if (socket_ifname && socket_ifname->size() > 1) return filter(*socket_ifname);
  for (const char* spec : {"ib", "^docker,lo,virbr", "docker", "lo", "virbr"}) {
    auto picked = filter(spec);
    if (!picked.empty()) return picked;
  }
  return {};
  // END SOLUTION
}

std::optional<LinkDiagnosis> check_socket_ifname(const EnvLookup& env,
                                                 const std::vector<std::string>& interfaces,
                                                 const std::string& cluster_interface) {
  // BEGIN SOLUTION: what nccl_pick_interfaces() takes for this environment must be exactly
  //   {cluster_interface}; otherwise say what it takes and the exact-name fix
  //   (L05Reading.SocketIfname*; README section 9)
  if (std::find(interfaces.begin(), interfaces.end(), cluster_interface) == interfaces.end()) {
    throw std::invalid_argument(fmt::format("'{}' is not an interface here (there are: {})",
                                            cluster_interface, join(interfaces)));
  }
  const auto value = env("NCCL_SOCKET_IFNAME");
  const auto picked = nccl_pick_interfaces(value, interfaces);
  if (picked == std::vector<std::string>{cluster_interface}) return std::nullopt;
  LinkDiagnosis d;
  d.variables = {"NCCL_SOCKET_IFNAME"};
  const std::string setting = value ? "NCCL_SOCKET_IFNAME=" + *value : "NCCL_SOCKET_IFNAME unset";
  const std::string fix = "set NCCL_SOCKET_IFNAME==" + cluster_interface +
                          " (the value =" + cluster_interface + ", an exact name)";
  if (picked.empty()) {
    d.why = fmt::format(
        "{} selects no interface: NCCL fails at bootstrap (no socket interface "
        "found); {}",
        setting, fix);
  } else if (picked[0] != cluster_interface) {
    d.why = fmt::format(
        "{} selects {}: NCCL bootstraps on {}, not on {}, and the job hangs or "
        "times out at init; {}",
        setting, join(picked), picked[0], cluster_interface, fix);
  } else {
    d.why = fmt::format(
        "{} selects {}: the bootstrap is right, but socket traffic may also go "
        "over {}; {}",
        setting, join(picked), join({picked.begin() + 1, picked.end()}), fix);
  }
  return d;
  // END SOLUTION
}

}  // namespace dtc::l05
