#include "dtc/launch.h"

#include <fmt/format.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "dtc/errors.h"

namespace dtc {
namespace {

// Parses an integer variable; nullopt when unset.
std::optional<int> int_var(const EnvLookup& env, const std::string& name) {
  auto value = env(name);
  if (!value) return std::nullopt;
  const std::string& s = *value;
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE || v < INT_MIN || v > INT_MAX) {
    throw UsageError(name, fmt::format("'{}' is not an integer", s),
                     fmt::format("set {} to a whole number, or unset it", name));
  }
  return static_cast<int>(v);
}

int required_int(const EnvLookup& env, const std::string& name, const std::string& why) {
  auto v = int_var(env, name);
  if (!v) {
    throw UsageError(name, "is not set, but " + why,
                     "launch with torchrun (it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR "
                     "and MASTER_PORT together), or unset the partial set of variables");
  }
  return *v;
}

void check_range(const std::string& name, int value, int lo, int hi_exclusive,
                 const std::string& hi_name) {
  if (value < lo || value >= hi_exclusive) {
    throw UsageError(name,
                     fmt::format("{} is outside 0..{} ({} is {})", value, hi_exclusive - 1, hi_name,
                                 hi_exclusive),
                     fmt::format("each rank needs 0 <= {} < {}", name, hi_name));
  }
}

void read_master(const EnvLookup& env, LaunchEnv& out, bool required) {
  auto addr = env("MASTER_ADDR");
  auto port = int_var(env, "MASTER_PORT");
  if (required && !addr) {
    throw UsageError("MASTER_ADDR", "is not set, but RANK and WORLD_SIZE are",
                     "export MASTER_ADDR=<host of rank 0> (torchrun sets it for you)");
  }
  if (required && !port) {
    throw UsageError("MASTER_PORT", "is not set, but RANK and WORLD_SIZE are",
                     "export MASTER_PORT=<free port, e.g. 29500> (torchrun sets it for you)");
  }
  if (addr) {
    if (addr->empty()) {
      throw UsageError("MASTER_ADDR", "is empty", "set it to the host name or address of rank 0");
    }
    out.master_addr = *addr;
  }
  if (port) {
    if (*port < 1 || *port > 65535) {
      throw UsageError("MASTER_PORT", fmt::format("{} is not a TCP port", *port),
                       "use a port between 1 and 65535, e.g. 29500");
    }
    out.master_port = *port;
  }
}

LaunchEnv read_torchrun(const EnvLookup& env) {
  LaunchEnv out;
  out.launcher = Launcher::kTorchrun;
  const std::string why = "RANK is set (a launcher sets them together)";
  out.world_size = required_int(env, "WORLD_SIZE", why);
  out.rank = *int_var(env, "RANK");
  if (out.world_size < 1) {
    throw UsageError("WORLD_SIZE",
                     fmt::format("{} is not a positive number of ranks", out.world_size),
                     "set WORLD_SIZE to the total number of processes (nnodes x nproc_per_node)");
  }
  check_range("RANK", out.rank, 0, out.world_size, "WORLD_SIZE");
  // LOCAL_RANK and LOCAL_WORLD_SIZE are optional for a hand-made launch: default to one node.
  out.local_rank = int_var(env, "LOCAL_RANK").value_or(out.rank);
  out.local_world_size = int_var(env, "LOCAL_WORLD_SIZE").value_or(out.world_size);
  if (out.local_world_size < 1 || out.local_world_size > out.world_size) {
    throw UsageError(
        "LOCAL_WORLD_SIZE",
        fmt::format("{} does not fit WORLD_SIZE {}", out.local_world_size, out.world_size),
        "LOCAL_WORLD_SIZE is the number of ranks on this node: 1..WORLD_SIZE");
  }
  check_range("LOCAL_RANK", out.local_rank, 0, out.local_world_size, "LOCAL_WORLD_SIZE");
  out.group_rank = int_var(env, "GROUP_RANK").value_or(out.rank / out.local_world_size);
  read_master(env, out, /*required=*/true);
  auto agent = env("TORCHELASTIC_USE_AGENT_STORE");
  out.use_agent_store = agent && (*agent == "True" || *agent == "true" || *agent == "1");
  out.restart_count = int_var(env, "TORCHELASTIC_RESTART_COUNT").value_or(0);
  out.max_restarts = int_var(env, "TORCHELASTIC_MAX_RESTARTS").value_or(0);
  if (out.restart_count < 0) {
    throw UsageError("TORCHELASTIC_RESTART_COUNT", "is negative", "unset it, or set it to 0");
  }
  out.run_id = env("TORCHELASTIC_RUN_ID").value_or("");
  return out;
}

LaunchEnv read_mpi(const EnvLookup& env) {
  LaunchEnv out;
  out.launcher = Launcher::kMpi;
  const std::string why = "OMPI_COMM_WORLD_RANK is set";
  out.world_size = required_int(env, "OMPI_COMM_WORLD_SIZE", why);
  out.rank = *int_var(env, "OMPI_COMM_WORLD_RANK");
  if (out.world_size < 1) {
    throw UsageError("OMPI_COMM_WORLD_SIZE", "is not a positive number of ranks",
                     "start the program with mpirun -np N");
  }
  check_range("OMPI_COMM_WORLD_RANK", out.rank, 0, out.world_size, "OMPI_COMM_WORLD_SIZE");
  out.local_rank = int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK").value_or(out.rank);
  out.local_world_size = int_var(env, "OMPI_COMM_WORLD_LOCAL_SIZE").value_or(out.world_size);
  check_range("OMPI_COMM_WORLD_LOCAL_RANK", out.local_rank, 0, out.local_world_size,
              "OMPI_COMM_WORLD_LOCAL_SIZE");
  // The node index. Not OMPI_COMM_WORLD_NODE_RANK: despite its name, OpenMPI 4 sets it to the
  // process's index on its node (1 for the second rank of a one-node job).
  out.group_rank = out.rank / out.local_world_size;
  read_master(env, out, /*required=*/false);  // single node: 127.0.0.1:29500 by default
  return out;
}

// SLURM_STEP_TASKS_PER_NODE, e.g. "4(x2),3": 4 tasks on each of the first two nodes, 3 on the
// third. The count on node @p node.
int tasks_on_node(const std::string& spec, int node) {
  int index = 0;
  std::string item;
  std::stringstream in(spec);
  auto bad = [&] {
    return UsageError("SLURM_STEP_TASKS_PER_NODE",
                      fmt::format("'{}' is not srun's list of tasks per node", spec),
                      "run the program as a task of `srun` (which sets it), e.g. srun -N2 "
                      "--ntasks-per-node=8 build/bin/lesson06 ...");
  };
  while (std::getline(in, item, ',')) {
    int count = 0, repeat = 1;
    char close = 0;
    if (std::sscanf(item.c_str(), "%d(x%d%c", &count, &repeat, &close) == 3 && close == ')') {
    } else if (std::sscanf(item.c_str(), "%d%c", &count, &close) != 1) {
      throw bad();
    }
    if (count < 1 || repeat < 1) throw bad();
    if (node < index + repeat) return count;
    index += repeat;
  }
  throw UsageError("SLURM_NODEID",
                   fmt::format("node {} is past SLURM_STEP_TASKS_PER_NODE '{}'", node, spec),
                   "run the program as a task of `srun`, which sets both");
}

LaunchEnv read_slurm(const EnvLookup& env) {
  LaunchEnv out;
  out.launcher = Launcher::kSlurm;
  const std::string why = "SLURM_PROCID and SLURM_STEP_NUM_TASKS are set (srun sets them together)";
  out.world_size = required_int(env, "SLURM_STEP_NUM_TASKS", why);
  out.rank = *int_var(env, "SLURM_PROCID");
  if (out.world_size < 1) {
    throw UsageError("SLURM_STEP_NUM_TASKS", "is not a positive number of tasks",
                     "start the program with srun -n N");
  }
  check_range("SLURM_PROCID", out.rank, 0, out.world_size, "SLURM_STEP_NUM_TASKS");
  out.group_rank = int_var(env, "SLURM_NODEID").value_or(0);
  out.local_rank = int_var(env, "SLURM_LOCALID").value_or(0);
  auto per_node = env("SLURM_STEP_TASKS_PER_NODE");
  out.local_world_size = per_node ? tasks_on_node(*per_node, out.group_rank) : out.world_size;
  check_range("SLURM_LOCALID", out.local_rank, 0, out.local_world_size,
              "the tasks on this node (SLURM_STEP_TASKS_PER_NODE)");
  auto nodes = int_var(env, "SLURM_STEP_NUM_NODES");
  const bool several_nodes = nodes && *nodes > 1;
  if (several_nodes && !env("MASTER_ADDR")) {
    throw UsageError("MASTER_ADDR", "is not set, and this srun step spans several nodes",
                     "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | "
                     "head -n 1) and MASTER_PORT=29500 before srun (Slurm does not pick a store "
                     "address; scripts/slurm/srun.sbatch does it)");
  }
  read_master(env, out, /*required=*/false);  // one node: 127.0.0.1:29500 by default
  out.run_id = env("SLURM_JOB_ID").value_or("");
  return out;
}

}  // namespace

const char* launcher_name(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone: return "none";
    case Launcher::kTorchrun: return "torchrun";
    case Launcher::kMpi: return "mpirun";
    case Launcher::kSlurm: return "srun";
  }
  return "?";
}

std::string LaunchEnv::store_prefix() const { return fmt::format("attempt{}/", restart_count); }

std::string LaunchEnv::describe() const {
  return fmt::format("rank {}/{} (local {}/{}, node {}) via {}, store {}:{}{}", rank, world_size,
                     local_rank, local_world_size, group_rank, launcher_name(launcher), master_addr,
                     master_port, use_agent_store ? " (agent's)" : "");
}

std::optional<std::string> process_env(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

LaunchEnv read_launch_env(const EnvLookup& env) {
  const bool torchrun = env("RANK").has_value();
  const bool mpi = env("OMPI_COMM_WORLD_RANK").has_value();
  if (torchrun) {
    return read_torchrun(env);  // torchrun's variables win: `mpirun torchrun ...` is torchrun
  }
  if (mpi) return read_mpi(env);
  // An srun task; not the batch script, which has SLURM_PROCID but no job step of tasks.
  if (env("SLURM_PROCID") && env("SLURM_STEP_NUM_TASKS")) return read_slurm(env);
  for (const char* orphan : {"WORLD_SIZE", "LOCAL_RANK"}) {
    if (env(orphan)) {
      throw UsageError(
          orphan, "is set but RANK is not",
          "launch with torchrun, which sets them together, or unset " + std::string(orphan));
    }
  }
  LaunchEnv out;  // a plain single-rank run
  read_master(env, out, /*required=*/false);
  return out;
}

std::optional<int> torchrun_generation(const EnvLookup& env) {
  auto agent = env("TORCHELASTIC_USE_AGENT_STORE");
  if (!env("TORCHELASTIC_RUN_ID") || !agent || *agent != "True") return std::nullopt;
  if (env("TORCHELASTIC_SIGNALS_TO_HANDLE") || env("TORCH_NCCL_ASYNC_ERROR_HANDLING")) return 2;
  if (env("NCCL_ASYNC_ERROR_HANDLING")) return 1;
  return std::nullopt;
}

void check_torchrun_generation(int torch_major, const std::string& torchrun_cmd,
                               const EnvLookup& env) {
  auto launcher = torchrun_generation(env);
  if (!launcher || (*launcher >= 2) == (torch_major >= 2)) return;
  throw UsageError(
      "torchrun",
      fmt::format("this program is built on LibTorch {}.x but was started by a torchrun {}.x, "
                  "whose store speaks another protocol (the first contact would end in a "
                  "'Socket Timeout')",
                  torch_major, *launcher),
      fmt::format("start it with the torchrun of this build:\n  {} --standalone "
                  "--nproc_per_node=N --no_python <program>\n(`make run-lessonNN` picks it for "
                  "you; the primary path's is in the course venv, the light path's is "
                  "/usr/bin/torchrun)",
                  torchrun_cmd));
}

void require_world_size(const LaunchEnv& env, int min_world, const std::string& program) {
  if (env.world_size >= min_world) return;
  throw UsageError(
      "WORLD_SIZE",
      fmt::format("{} needs at least {} ranks, but it was started as {} rank(s) ({})", program,
                  min_world, env.world_size, launcher_name(env.launcher)),
      fmt::format("run it with a launcher, e.g.\n  torchrun --nproc_per_node={} --no_python {}",
                  min_world, program));
}

}  // namespace dtc
