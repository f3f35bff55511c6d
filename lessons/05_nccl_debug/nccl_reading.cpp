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
  // TODO(L05)
  DTC_TODO("L05",
           "the first connection line from -> to (either end's), its family, GPUDirect "
           "RDMA on any of its lines, and same_node from both ranks' hosts; nullopt when there "
           "is none, "
           "and std::invalid_argument when a rank's host is unknown (L05Reading.ReadLink*; "
           "README section "
           "9)");
}

LinkDiagnosis explain_link(const LinkReading& link, const EnvLookup& env) {
  // TODO(L05)
  DTC_TODO("L05",
           "apply the contract's rules: the expected transport is healthy; otherwise "
           "name the variables set that forced each step down, in the rules' order "
           "(L05Reading.Explain*; README section 9)");
}

std::vector<std::string> nccl_pick_interfaces(const std::optional<std::string>& socket_ifname,
                                              const std::vector<std::string>& interfaces) {
  // TODO(L05)
  DTC_TODO("L05",
           "NCCL's rules in the contract: a set value (2 characters or more) is a "
           "prefix list, '^' excludes, '=' makes names exact; unset tries \"ib\", "
           "\"^docker,lo,virbr\", "
           "\"docker\", \"lo\", \"virbr\" in turn (L05Reading.PickInterfaces*; README section 9)");
}

std::optional<LinkDiagnosis> check_socket_ifname(const EnvLookup& env,
                                                 const std::vector<std::string>& interfaces,
                                                 const std::string& cluster_interface) {
  // TODO(L05)
  DTC_TODO("L05",
           "what nccl_pick_interfaces() takes for this environment must be exactly "
           "{cluster_interface}; otherwise say what it takes and the exact-name fix "
           "(L05Reading.SocketIfname*; README section 9)");
}

}  // namespace dtc::l05
// generated from solutions/05_nccl_debug/nccl_reading.cpp; checksum fcfc17cf5001f447
