// Lesson 05, given in full: `lesson05 doctor`, a pre-flight check of a launch environment and of
// the machine, with a fix for every finding.
//   build/bin/lesson05 doctor
//   GLOO_SOCKET_IFNAME=eth9 CUDA_VISIBLE_DEVICES=0,0 build/bin/lesson05 doctor   # two errors
// tests/lesson05/given_test.cpp (suite L05DoctorGiven) runs it on made-up environments and a
// made-up machine (Machine), so that every finding is checked without breaking a real network.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "dtc/launch.h"

namespace dtc::l05 {

/// How bad a finding is. The doctor's exit code is the worst one: 0 ok, 1 warning, 2 error.
enum class Severity { kOk = 0, kWarning = 1, kError = 2 };

/// One line of the doctor's report.
struct Finding {
  Severity severity = Severity::kOk;
  std::string subject;  ///< the variable or resource, e.g. "GLOO_SOCKET_IFNAME"
  std::string problem;  ///< what is wrong (or, for kOk, what was checked)
  std::string fix;      ///< how to fix it (empty for kOk)
};

/// What the doctor asks of the machine; tests replace it with a made-up one.
struct Machine {
  /// Names of the network interfaces (getifaddrs()), e.g. {"lo", "eth0"}.
  std::function<std::vector<std::string>()> interfaces;
  /// Whether a host name resolves (getaddrinfo()).
  std::function<bool(const std::string& host)> resolves;
  /// Whether something accepts TCP connections at host:port (connect()).
  std::function<bool(const std::string& host, int port)> listening;
  /// The names of the variables set in this process's environment (environ); when empty (not
  /// given), the spelling check is skipped.
  std::function<std::vector<std::string>()> environment;
};

/// The real machine.
Machine real_machine();

/// The interfaces NCCL's socket code considers on this machine (src/os/linux.cc): running, with
/// an IPv4 or IPv6 address (not the IPv6 loopback), in getifaddrs() order, IPv4 ones first; what
/// nccl_pick_interfaces() expects as its list.
std::vector<std::string> nccl_visible_interfaces();

/// Checks the environment @p env on machine @p machine: *_SOCKET_IFNAME against the real
/// interfaces (NCCL's prefixes: one that matches nothing is an error; one that matches several
/// interfaces, or selects lo, docker*, virbr* or veth*, a warning), CUDA_VISIBLE_DEVICES
/// (malformed, duplicated), MASTER_ADDR (resolvable), MASTER_PORT (a port; in use before a
/// launch, unreachable inside one), world-size variables (consistent with each other),
/// NCCL_* / TORCH_DISTRIBUTED_DEBUG / TORCH_CPP_LOG_LEVEL values (NCCL_ALGO and NCCL_PROTO with
/// NCCL's per-collective syntax), and the spelling of every NCCL_*, TORCH_NCCL_*, TORCH_FR_* and
/// TORCH_DISTRIBUTED_* name set (known_env.h: a name one or two letters from a known one is a
/// warning, as both libraries ignore it silently).
/// @return one Finding per check that ran, errors first, then warnings, then the ok lines.
std::vector<Finding> run_doctor(const EnvLookup& env, const Machine& machine);

/// The worst severity of @p findings (kOk when empty).
Severity worst(const std::vector<Finding>& findings);

/// Prints the report: one line per finding ("ERROR GLOO_SOCKET_IFNAME: ...") and its fix.
void print_findings(std::ostream& out, const std::vector<Finding>& findings);

}  // namespace dtc::l05
