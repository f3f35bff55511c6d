// Lesson 04, given in full: see env_vars.h.
#include "env_vars.h"

#include <fmt/format.h>

#include <cerrno>
#include <climits>
#include <cstdlib>

#include "dtc/errors.h"

namespace dtc::l04 {

EnvLookup lookup_in(EnvMap vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

std::optional<int> env_int(const EnvLookup& env, const std::string& name) {
  const auto value = env(name);
  if (!value) return std::nullopt;
  const std::string& s = *value;
  // strtol alone would accept " 2" and "2x" (it stops at the x): check every character.
  bool digits = !s.empty();
  for (size_t i = 0; i < s.size(); ++i) {
    const bool sign = i == 0 && s[i] == '-' && s.size() > 1;
    if (!sign && (s[i] < '0' || s[i] > '9')) digits = false;
  }
  errno = 0;
  const long v = digits ? std::strtol(s.c_str(), nullptr, 10) : 0;
  if (!digits || errno == ERANGE || v < INT_MIN || v > INT_MAX) {
    throw UsageError(name, fmt::format("'{}' is not an integer", s),
                     fmt::format("set {} to a whole number, or unset it", name));
  }
  return static_cast<int>(v);
}

int env_required_int(const EnvLookup& env, const std::string& name, const std::string& why) {
  const auto v = env_int(env, name);
  if (!v) {
    throw UsageError(name, "is not set, but " + why,
                     "launch with torchrun or mpirun, which set the variables together, or unset "
                     "the partial set you exported by hand");
  }
  return *v;
}

std::optional<bool> env_bool(const EnvLookup& env, const std::string& name) {
  const auto value = env(name);
  if (!value) return std::nullopt;
  if (*value == "True" || *value == "true" || *value == "1") return true;
  if (*value == "False" || *value == "false" || *value == "0") return false;
  throw UsageError(name, fmt::format("'{}' is not a boolean", *value),
                   "use True or False (torchrun writes True/False), or unset it");
}

std::string var_name(Launcher launcher, Var var) {
  const bool mpi = launcher == Launcher::kMpi;
  switch (var) {
    case Var::kRank: return mpi ? "OMPI_COMM_WORLD_RANK" : "RANK";
    case Var::kWorldSize: return mpi ? "OMPI_COMM_WORLD_SIZE" : "WORLD_SIZE";
    case Var::kLocalRank: return mpi ? "OMPI_COMM_WORLD_LOCAL_RANK" : "LOCAL_RANK";
    case Var::kLocalWorldSize: return mpi ? "OMPI_COMM_WORLD_LOCAL_SIZE" : "LOCAL_WORLD_SIZE";
  }
  return "?";
}

std::string shell_join(const std::vector<std::string>& args) {
  std::string out;
  for (const auto& a : args) {
    bool safe = !a.empty();
    for (char c : a) {
      const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      std::string("-_./=:,+@%").find(c) != std::string::npos;
      if (!ok) safe = false;
    }
    if (!out.empty()) out.push_back(' ');
    if (safe) {
      out.append(a);
      continue;
    }
    out.push_back('\'');  // 'it'\''s': close the quote, an escaped quote, reopen
    for (char c : a) {
      if (c == '\'') {
        out.append("'\\''");
      } else {
        out.push_back(c);
      }
    }
    out.push_back('\'');
  }
  return out;
}

const std::vector<VarDoc>& launch_variables() {
  // Observed under torchrun 2.15 (PyPI) and 1.13 (Debian) with `--no_python env`, and under
  // OpenMPI 4.1 with `mpirun -np 2 env`; see README section 3.
  static const std::vector<VarDoc> all = {
      {"RANK", "torchrun", "global rank, 0..WORLD_SIZE-1: who am I in the job"},
      {"WORLD_SIZE", "torchrun", "ranks in the job, all nodes together"},
      {"LOCAL_RANK", "torchrun", "rank on this node, 0..LOCAL_WORLD_SIZE-1: picks the GPU"},
      {"LOCAL_WORLD_SIZE", "torchrun", "ranks on this node (--nproc_per_node)"},
      {"GROUP_RANK", "torchrun", "this node's index, 0..GROUP_WORLD_SIZE-1 (the agent's rank)"},
      {"GROUP_WORLD_SIZE", "torchrun", "nodes (agents) in the job"},
      {"ROLE_NAME", "torchrun", "the workers' role: \"default\" (torchrun runs one role)"},
      {"ROLE_RANK", "torchrun", "rank among workers of the same role (= RANK under torchrun)"},
      {"ROLE_WORLD_SIZE", "torchrun", "workers of that role (= WORLD_SIZE under torchrun)"},
      {"MASTER_ADDR", "torchrun", "host of the job's TCPStore (rank 0's node)"},
      {"MASTER_PORT", "torchrun", "port of the job's TCPStore"},
      {"TORCHELASTIC_USE_AGENT_STORE", "torchrun",
       "True: the agent already serves the store at MASTER_ADDR:MASTER_PORT, every rank is a "
       "client (2.x); False: rank 0 must host it (1.13)"},
      {"TORCHELASTIC_RESTART_COUNT", "torchrun",
       "how many times the workers were restarted: 0 on the first attempt; scope store keys by it"},
      {"TORCHELASTIC_MAX_RESTARTS", "torchrun", "--max-restarts: restarts allowed before failing"},
      {"TORCHELASTIC_RUN_ID", "torchrun", "--rdzv_id: the job's id, the same on every node"},
      {"TORCHELASTIC_ERROR_FILE", "torchrun", "where a Python worker's @record writes its error"},
      {"TORCHELASTIC_SIGNALS_TO_HANDLE", "torchrun 2.x",
       "signals the agent forwards to the workers"},
      {"OMP_NUM_THREADS", "torchrun",
       "set to 1 when unset and nproc_per_node > 1, so N ranks do not each use every core"},
      {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "torchrun 2.x",
       "1: a failed NCCL collective aborts the rank (1.13: NCCL_ASYNC_ERROR_HANDLING)"},
      {"OMPI_COMM_WORLD_RANK", "mpirun", "global rank"},
      {"OMPI_COMM_WORLD_SIZE", "mpirun", "ranks in the job (-np)"},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "mpirun", "rank on this node"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun", "ranks on this node"},
      {"OMPI_COMM_WORLD_NODE_RANK", "mpirun",
       "NOT the node index: the process's rank on its node across jobs (do not use)"},
      {"GLOO_SOCKET_IFNAME", "you", "network interface gloo binds to, e.g. eth0 or veth0"},
      {"NCCL_SOCKET_IFNAME", "you", "network interface NCCL bootstraps over (lesson 05)"},
      {"CUDA_VISIBLE_DEVICES", "you / Slurm", "which GPUs this process sees, renumbered from 0"},
  };
  return all;
}

}  // namespace dtc::l04
