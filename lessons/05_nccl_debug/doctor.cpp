// Lesson 05, given in full: the doctor's checks (contract: doctor.h). Each check reads a few
// variables and adds findings; the order of the file is the order of a pre-flight checklist:
// network interfaces, devices, the store's address and port, the world size, then the values of
// the debugging and tuning variables.
#include "doctor.h"

#include "known_env.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <map>
#include <optional>
#include <ostream>
#include <set>
#include <sstream>

extern char** environ;  // POSIX: the process's environment, NAME=value

namespace dtc::l05 {
namespace {

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, sep)) out.push_back(item);
  if (!text.empty() && text.back() == sep) out.push_back("");
  return out;
}

std::optional<long> to_int(const std::string& text) {
  if (text.empty() || text.size() > 9) return std::nullopt;
  size_t i = text[0] == '-' ? 1 : 0;
  if (i == text.size()) return std::nullopt;
  for (; i < text.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(text[i]))) return std::nullopt;
  }
  return std::stol(text);
}

std::string upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

struct Report {
  std::vector<Finding> findings;
  void ok(const std::string& subject, const std::string& what) {
    findings.push_back({Severity::kOk, subject, what, ""});
  }
  void warn(const std::string& subject, const std::string& problem, const std::string& fix) {
    findings.push_back({Severity::kWarning, subject, problem, fix});
  }
  void error(const std::string& subject, const std::string& problem, const std::string& fix) {
    findings.push_back({Severity::kError, subject, problem, fix});
  }
};

// --- 1. network interfaces ------------------------------------------------------------------
// GLOO_SOCKET_IFNAME: exact interface names, comma-separated (PyTorch >= 2.0 takes a list).
// NCCL_SOCKET_IFNAME: prefixes ("eth" matches eth0, eth1), "=eth0" an exact name, "^docker" an
// exclusion list (NCCL docs, "Environment Variables", NCCL_SOCKET_IFNAME).
void check_ifnames(const EnvLookup& env, const Machine& machine, Report& r) {
  const auto have = machine.interfaces();
  const std::string have_list = fmt::format("{}", fmt::join(have, ", "));
  auto exists = [&](const std::string& name) {
    return std::find(have.begin(), have.end(), name) != have.end();
  };
  if (auto v = env("GLOO_SOCKET_IFNAME")) {
    bool bad = false;
    for (const auto& name : split(*v, ',')) {
      if (!exists(name)) {
        bad = true;
        r.error("GLOO_SOCKET_IFNAME", fmt::format("interface '{}' does not exist here", name),
                fmt::format("use one of: {} (`ip -br addr`), or unset it", have_list));
      }
    }
    if (!bad) r.ok("GLOO_SOCKET_IFNAME", fmt::format("'{}' exists", *v));
  }
  if (auto v = env("NCCL_SOCKET_IFNAME")) {
    std::string list = *v;
    if (list.size() < 2) {
      // NCCL reads the variable only when it has 2 characters or more (ncclFindInterfaces).
      r.warn("NCCL_SOCKET_IFNAME",
             fmt::format("'{}' is ignored: NCCL reads values of 2 characters or more, and chooses "
                         "by itself",
                         *v),
             "give a whole prefix or an exact name, e.g. NCCL_SOCKET_IFNAME==eth0 (the value "
             "=eth0), or unset it");
    } else if (list[0] == '^') {
      r.ok("NCCL_SOCKET_IFNAME", fmt::format("'{}' excludes interfaces; not checked", *v));
    } else {
      const bool exact = !list.empty() && list[0] == '=';
      if (exact) list = list.substr(1);
      bool bad = false;
      for (const auto& name : split(list, ',')) {
        std::vector<std::string> matched;
        for (const auto& h : have) {
          if (exact ? h == name : (!name.empty() && h.rfind(name, 0) == 0)) matched.push_back(h);
        }
        if (matched.empty()) {
          bad = true;
          r.error("NCCL_SOCKET_IFNAME",
                  fmt::format("no interface {} '{}' here", exact ? "named" : "starting with", name),
                  fmt::format("use one of: {}; NCCL reads prefixes ('eth'), '=eth0' for an exact "
                              "name, '^docker,lo' to exclude",
                              have_list));
          continue;
        }
        // The silent failures: a prefix that takes more than the cluster network (eth0 also
        // matches eth0.100), or an interface other nodes cannot reach, which NCCL's default
        // (no variable set) would have skipped: lo and docker*.
        if (matched.size() > 1) {
          bad = true;
          r.warn("NCCL_SOCKET_IFNAME",
                 fmt::format("prefix '{}' matches {} interfaces: {}", name, matched.size(),
                             fmt::join(matched, ", ")),
                 fmt::format("NCCL bootstraps on the first it finds and may send data over all of "
                             "them, and another node can pick another; name one exactly: "
                             "NCCL_SOCKET_IFNAME=={}",
                             matched.front()));
        }
        for (const auto& h : matched) {
          for (const char* local : {"lo", "docker", "virbr", "veth"}) {
            if (h.rfind(local, 0) != 0) continue;
            bad = true;
            r.warn("NCCL_SOCKET_IFNAME",
                   fmt::format("'{}' selects {}, which other nodes cannot reach", name, h),
                   "name the interface of the cluster network (`ip -br addr`: the one with the "
                   "address the other nodes use); unset, NCCL skips lo and docker*");
          }
        }
      }
      if (!bad) r.ok("NCCL_SOCKET_IFNAME", fmt::format("'{}' matches one interface", *v));
    }
  }
}

// --- 2. devices -------------------------------------------------------------------------------
// CUDA_VISIBLE_DEVICES: indices (0,1), or GPU-/MIG- UUIDs; CUDA stops reading the list at the
// first invalid entry, so "0,x,1" silently means "0".
void check_cuda_visible(const EnvLookup& env, Report& r) {
  auto v = env("CUDA_VISIBLE_DEVICES");
  if (!v) return;
  if (v->empty()) {
    r.warn("CUDA_VISIBLE_DEVICES", "is set but empty: no GPU is visible to this process",
           "unset it, or list devices: CUDA_VISIBLE_DEVICES=0,1");
    return;
  }
  std::set<std::string> seen;
  bool bad = false;
  for (const auto& item : split(*v, ',')) {
    const bool uuid = item.rfind("GPU-", 0) == 0 || item.rfind("MIG-", 0) == 0;
    const auto n = to_int(item);
    if (!uuid && (!n || *n < 0)) {
      bad = true;
      r.error("CUDA_VISIBLE_DEVICES",
              fmt::format("'{}' in '{}' is not a device index or GPU-/MIG- UUID", item, *v),
              "a comma-separated list without spaces, e.g. 0,1 (`nvidia-smi -L` lists them); CUDA "
              "ignores everything from the first bad entry on");
    } else if (!seen.insert(uuid ? item : std::to_string(*n)).second) {
      bad = true;
      r.error("CUDA_VISIBLE_DEVICES", fmt::format("device '{}' is listed twice in '{}'", item, *v),
              "list each device once: two ranks on one GPU make NCCL fail ('Duplicate GPU "
              "detected')");
    }
  }
  if (!bad) r.ok("CUDA_VISIBLE_DEVICES", fmt::format("'{}' is well formed", *v));
}

// --- 3. the store's address and port ------------------------------------------------------
void check_master(const EnvLookup& env, const Machine& machine, Report& r) {
  const auto addr = env("MASTER_ADDR");
  const auto port_text = env("MASTER_PORT");
  if (addr) {
    if (machine.resolves(*addr)) {
      r.ok("MASTER_ADDR", fmt::format("'{}' resolves", *addr));
    } else {
      r.error("MASTER_ADDR", fmt::format("'{}' does not resolve", *addr),
              "use an IP address or a name in /etc/hosts or DNS (`getent hosts NAME`)");
    }
  }
  if (!port_text) return;
  const auto port = to_int(*port_text);
  if (!port || *port < 1 || *port > 65535) {
    r.error("MASTER_PORT", fmt::format("'{}' is not a port (1..65535)", *port_text),
            "pick a free port, e.g. 29500");
    return;
  }
  if (!addr || !machine.resolves(*addr)) return;
  const bool inside_job = env("RANK").has_value() || env("OMPI_COMM_WORLD_RANK").has_value();
  const bool open = machine.listening(*addr, static_cast<int>(*port));
  if (inside_job && !open) {
    r.error("MASTER_PORT",
            fmt::format("nothing listens at {}:{} inside a launched job", *addr, *port),
            "rank 0 (or torchrun's agent) should host the store there: is it up, and does a "
            "firewall let the port through?");
  } else if (!inside_job && open) {
    r.error("MASTER_PORT", fmt::format("{}:{} is already in use before the launch", *addr, *port),
            "pick another port (`ss -ltnp` shows who holds it), or stop the old job");
  } else {
    r.ok("MASTER_PORT", fmt::format("{} {}", *port, inside_job ? "reachable" : "free"));
  }
}

// --- 4. the world size --------------------------------------------------------------------
void check_world(const EnvLookup& env, Report& r) {
  auto num = [&](const char* name) -> std::optional<long> {
    auto v = env(name);
    if (!v) return std::nullopt;
    auto n = to_int(*v);
    if (!n) {
      r.error(name, fmt::format("'{}' is not an integer", *v), "launch with torchrun or mpirun");
    }
    return n;
  };
  const auto world = num("WORLD_SIZE");
  const auto rank = num("RANK");
  const auto local_world = num("LOCAL_WORLD_SIZE");
  const auto local_rank = num("LOCAL_RANK");
  const auto groups = num("GROUP_WORLD_SIZE");
  const auto mpi_world = num("OMPI_COMM_WORLD_SIZE");
  const size_t before = r.findings.size();
  if (world && *world < 1) r.error("WORLD_SIZE", "must be at least 1", "launch with torchrun");
  if (world && rank && (*rank < 0 || *rank >= *world)) {
    r.error("RANK", fmt::format("{} is outside WORLD_SIZE={}", *rank, *world),
            "RANK must be in [0, WORLD_SIZE): a hand-set variable left over?");
  }
  if (world && mpi_world && *world != *mpi_world) {
    r.error("WORLD_SIZE", fmt::format("{} but OMPI_COMM_WORLD_SIZE={}", *world, *mpi_world),
            "one launcher at a time: unset the stale WORLD_SIZE, or launch with torchrun only");
  }
  if (world && local_world && *local_world > *world) {
    r.error("LOCAL_WORLD_SIZE", fmt::format("{} > WORLD_SIZE={}", *local_world, *world),
            "a node cannot hold more ranks than the job");
  }
  if (local_world && local_rank && (*local_rank < 0 || *local_rank >= *local_world)) {
    r.error("LOCAL_RANK",
            fmt::format("{} is outside LOCAL_WORLD_SIZE={}", *local_rank, *local_world),
            "LOCAL_RANK must be in [0, LOCAL_WORLD_SIZE)");
  }
  if (world && local_world && groups && *groups * *local_world != *world) {
    r.warn("WORLD_SIZE",
           fmt::format("{} != GROUP_WORLD_SIZE {} x LOCAL_WORLD_SIZE {}", *world, *groups,
                       *local_world),
           "nodes with different --nproc_per_node: fine if meant, else check each node's flags");
  }
  if (world && r.findings.size() == before) {
    r.ok("WORLD_SIZE", fmt::format("{} is consistent with the other variables", *world));
  }
}

// --- 5. values of debugging and tuning variables ----------------------------------------
// Allowed values from NCCL's "Environment Variables" page and PyTorch's distributed docs.
struct Choice {
  const char* name;
  std::vector<std::string> values;  // upper case; empty: 0/1
  bool list = false;                // comma-separated, optional leading '^'
};

const std::vector<Choice>& choices() {
  static const std::vector<Choice> c = {
      {"NCCL_DEBUG", {"VERSION", "WARN", "INFO", "TRACE"}},
      {"NCCL_DEBUG_SUBSYS",
       {"INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC", "ALLOC_HOST",
        "CALL", "PROXY", "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS", "DESTROY", "ALL"},
       true},
      {"NCCL_P2P_DISABLE", {}},
      {"NCCL_SHM_DISABLE", {}},
      {"NCCL_IB_DISABLE", {}},
      {"NCCL_NET_GDR_READ", {}},
      {"NCCL_P2P_LEVEL", {"LOC", "NVL", "PIX", "PXB", "PHB", "SYS", "0", "1", "2", "3", "4", "5"}},
      {"TORCH_DISTRIBUTED_DEBUG", {"OFF", "INFO", "DETAIL"}},
      {"TORCH_CPP_LOG_LEVEL", {"INFO", "WARNING", "ERROR", "FATAL", "0", "1", "2", "3"}},
      {"TORCH_NCCL_ASYNC_ERROR_HANDLING", {"0", "1", "2", "3"}},
      {"TORCH_NCCL_BLOCKING_WAIT", {}},
  };
  return c;
}

// NCCL_ALGO and NCCL_PROTO: "ring,tree", "^LL128", or per collective (NCCL 2.24+, tuning.cc's
// parseList): "ring;allreduce:tree,ring;broadcast:^tree", where only the first entry may lack a
// collective's name. Names are case-insensitive.
void check_algo_proto(const EnvLookup& env, Report& r) {
  static const std::vector<std::string> functions = {"BROADCAST", "REDUCE", "ALLGATHER",
                                                     "REDUCESCATTER", "ALLREDUCE"};
  const std::pair<const char*, std::vector<std::string>> vars[] = {
      {"NCCL_ALGO", {"TREE", "RING", "COLLNETDIRECT", "COLLNETCHAIN", "NVLS", "NVLSTREE", "PAT"}},
      {"NCCL_PROTO", {"LL", "LL128", "SIMPLE"}}};
  auto listed = [](const std::vector<std::string>& names, const std::string& item) {
    return std::find(names.begin(), names.end(), upper(item)) != names.end();
  };
  for (const auto& [name, allowed] : vars) {
    auto v = env(name);
    if (!v) continue;
    std::vector<std::string> bad;
    const auto entries = split(*v, ';');
    for (size_t e = 0; e < entries.size(); ++e) {
      std::string list = entries[e];
      const auto colon = list.find(':');
      if (colon != std::string::npos) {
        if (!listed(functions, list.substr(0, colon))) bad.push_back(list.substr(0, colon));
        list = list.substr(colon + 1);
      } else if (e > 0) {
        bad.push_back(entries[e] + " (only the first entry may omit the collective)");
      }
      if (!list.empty() && list[0] == '^') list = list.substr(1);
      for (const auto& item : split(list, ',')) {
        if (!listed(allowed, item)) bad.push_back(item);
      }
    }
    if (bad.empty()) {
      r.ok(name, fmt::format("'{}' is valid", *v));
    } else {
      r.error(name, fmt::format("'{}' is not valid here", fmt::join(bad, "', '")),
              fmt::format("a comma list of {} ('^' first to exclude), optionally per collective "
                          "after the first: '...;allreduce:tree' (NCCL 2.24+; {})",
                          fmt::join(allowed, ", "), fmt::join(functions, ", ")));
    }
  }
}

// --- 6. spelling ----------------------------------------------------------------------------
// NCCL and PyTorch read the variables they know and ignore the rest: NCCL_SOCKET_IFNAMES=eth0
// does nothing, silently. A name with their prefixes that is not known (known_env.h) but is one
// or two edits from a known one is almost certainly a typo.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

void check_spelling(const std::vector<std::string>& names, Report& r) {
  for (const auto& name : names) {
    const bool ours = name.rfind("NCCL_", 0) == 0 || name.rfind("TORCH_NCCL_", 0) == 0 ||
                      name.rfind("TORCH_FR_", 0) == 0 || name.rfind("TORCH_DISTRIBUTED_", 0) == 0;
    if (!ours) continue;
    std::string nearest;
    size_t best = 3;
    for (const char* known : kKnownEnvNames) {
      const size_t d = edit_distance(name, known);
      if (d == 0) {
        best = 0;
        break;
      }
      if (d < best) {
        best = d;
        nearest = known;
      }
    }
    if (best == 0 || nearest.empty()) continue;  // known, or too far from any to guess
    r.warn(name, fmt::format("is not a variable NCCL or PyTorch reads; did you mean {}?", nearest),
           fmt::format("rename it to {}: a misspelt name is ignored without a word", nearest));
  }
}

void check_values(const EnvLookup& env, Report& r) {
  for (const auto& c : choices()) {
    auto v = env(c.name);
    if (!v) continue;
    std::vector<std::string> allowed =
        c.values.empty() ? std::vector<std::string>{"0", "1"} : c.values;
    std::string text = *v;
    if (c.list && !text.empty() && text[0] == '^') text = text.substr(1);
    std::vector<std::string> bad;
    for (const auto& item : c.list ? split(text, ',') : std::vector<std::string>{text}) {
      if (std::find(allowed.begin(), allowed.end(), upper(item)) == allowed.end())
        bad.push_back(item);
    }
    if (bad.empty()) {
      r.ok(c.name, fmt::format("'{}' is valid", *v));
    } else {
      r.error(c.name, fmt::format("'{}' is not a valid value", fmt::join(bad, ",")),
              fmt::format("use {}{}", c.list ? "a comma list of " : "one of ",
                          fmt::join(allowed, ", ")));
    }
  }
  check_algo_proto(env, r);
  // NCCL_IB_HCA: "mlx5_0:1,mlx5_1", prefixes like NCCL_SOCKET_IFNAME; check its shape only.
  if (auto v = env("NCCL_IB_HCA")) {
    std::string text = *v;
    if (!text.empty() && (text[0] == '^' || text[0] == '=')) text = text.substr(1);
    bool bad = text.empty();
    for (const auto& item : split(text, ',')) {
      const auto colon = item.find(':');
      if (item.empty() || colon == 0 ||
          (colon != std::string::npos && !to_int(item.substr(colon + 1)))) {
        bad = true;
      }
    }
    if (bad) {
      r.error("NCCL_IB_HCA", fmt::format("'{}' is malformed", *v),
              "HCA names with optional ports: mlx5_0:1,mlx5_1 (`ibv_devices` lists them)");
    } else {
      r.ok("NCCL_IB_HCA", fmt::format("'{}' is well formed", *v));
    }
  }
}

}  // namespace

namespace {

// The machine's interface names in getifaddrs() order, each once. nccl_view: only those NCCL's
// socket code considers (src/os/linux.cc): running, with an IPv4 or IPv6 address (not the IPv6
// loopback), IPv4 ones first.
std::vector<std::string> interface_names(bool nccl_view) {
  std::vector<std::string> v4, other;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return {};
  for (auto* a = list; a != nullptr; a = a->ifa_next) {
    auto* out = &other;
    if (nccl_view) {
      if (a->ifa_addr == nullptr || !(a->ifa_flags & IFF_RUNNING)) continue;
      const int family = a->ifa_addr->sa_family;
      if (family != AF_INET && family != AF_INET6) continue;
      if (family == AF_INET6 &&
          IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr)) {
        continue;
      }
      if (family == AF_INET) out = &v4;
    }
    if (std::find(out->begin(), out->end(), a->ifa_name) == out->end()) {
      out->emplace_back(a->ifa_name);
    }
  }
  freeifaddrs(list);
  for (const auto& n : other) {
    if (std::find(v4.begin(), v4.end(), n) == v4.end()) v4.push_back(n);
  }
  return v4;
}

}  // namespace

std::vector<std::string> nccl_visible_interfaces() { return interface_names(true); }

Machine real_machine() {
  Machine m;
  m.interfaces = [] { return interface_names(false); };
  m.resolves = [](const std::string& host) {
    addrinfo* res = nullptr;
    const int rc = getaddrinfo(host.c_str(), nullptr, nullptr, &res);
    if (res) freeaddrinfo(res);
    return rc == 0;
  };
  m.listening = [](const std::string& host, int port) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return false;
    bool open = false;
    for (auto* a = res; a != nullptr && !open; a = a->ai_next) {
      const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
      if (fd < 0) continue;
      open = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
      close(fd);
    }
    freeaddrinfo(res);
    return open;
  };
  m.environment = [] {
    std::vector<std::string> names;
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      const std::string entry = *e;
      names.push_back(entry.substr(0, entry.find('=')));
    }
    return names;
  };
  return m;
}

std::vector<Finding> run_doctor(const EnvLookup& env, const Machine& machine) {
  Report r;
  check_ifnames(env, machine, r);
  check_cuda_visible(env, r);
  check_master(env, machine, r);
  check_world(env, r);
  check_values(env, r);
  if (machine.environment) check_spelling(machine.environment(), r);
  std::stable_sort(r.findings.begin(), r.findings.end(), [](const Finding& a, const Finding& b) {
    return static_cast<int>(a.severity) > static_cast<int>(b.severity);
  });
  return r.findings;
}

Severity worst(const std::vector<Finding>& findings) {
  Severity w = Severity::kOk;
  for (const auto& f : findings) w = std::max(w, f.severity);
  return w;
}

void print_findings(std::ostream& out, const std::vector<Finding>& findings) {
  if (findings.empty()) {
    out << "doctor: no launch or NCCL variables set; nothing to check\n";
    return;
  }
  for (const auto& f : findings) {
    const char* tag = f.severity == Severity::kError     ? "ERROR"
                      : f.severity == Severity::kWarning ? "WARN "
                                                         : "ok   ";
    out << tag << " " << f.subject << ": " << f.problem << "\n";
    if (!f.fix.empty()) out << "      fix: " << f.fix << "\n";
  }
}

}  // namespace dtc::l05
