// Lesson 04: read the launch environment. Implements lessons/04_launch/launch_env.h.
//
// Fill in every TODO(L04) below, top to bottom; `make test-lesson04` checks each function on
// made-up environments (closed-form expectations), and the end-to-end tests start the reference
// program under torchrun, mpirun and two simulated nodes (README section 8).
#include "launch_env.h"

#include <fmt/format.h>

#include "dtc/errors.h"
#include "dtc/todo.h"
#include "env_vars.h"

namespace dtc::l04 {
namespace {

// Throws "<name>: <value> is outside 0..<hi-1> (<hi_name> is <hi>)" unless lo <= value < hi.
// (maybe_unused: the untouched exercise does not call it yet.)
[[maybe_unused]] void check_range(const std::string& name, int value, int lo, int hi,
                                  const std::string& hi_name) {
  if (value >= lo && value < hi) return;
  throw UsageError(name,
                   fmt::format("{} is outside {}..{} ({} is {})", value, lo, hi - 1, hi_name, hi),
                   fmt::format("each rank needs {} <= {} < {}; a launcher sets them together, so "
                               "look for a value exported by hand",
                               lo, name, hi_name));
}

}  // namespace

Launcher detect_launcher(const EnvLookup& env) {
  // BEGIN SOLUTION: the launcher whose variables are set (torchrun's win over mpirun's); with
  //   neither, a stray torchrun variable is a UsageError naming it, in the header's order
  //   (L04Detect.*; hints: README section 9)
  if (env("RANK")) return Launcher::kTorchrun;  // first: `mpirun torchrun ...` is torchrun
  if (env("OMPI_COMM_WORLD_RANK")) return Launcher::kMpi;
  for (const char* stray : {"WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"}) {
    if (env(stray)) {
      throw UsageError(
          stray, "is set but RANK is not",
          fmt::format("launch with torchrun, which sets them together, or `unset {}`", stray));
    }
  }
  return Launcher::kNone;
  // END SOLUTION
}

LaunchInfo parse_torchrun(const EnvLookup& env) {
  LaunchInfo info;
  info.launcher = Launcher::kTorchrun;
  const std::string why = "RANK is set (torchrun sets them together)";
  // BEGIN SOLUTION: every field from torchrun's variables: the six required ones must be set,
  //   the others take the header's defaults, and LOCAL_WORLD_SIZE=0 must reach validate(), not
  //   a division by zero (L04ParseTorchrun.*; hints: README section 9)
  info.rank = env_required_int(env, "RANK", why);
  info.world_size = env_required_int(env, "WORLD_SIZE", why);
  info.local_rank = env_required_int(env, "LOCAL_RANK", why);
  info.local_world_size = env_required_int(env, "LOCAL_WORLD_SIZE", why);
  const auto addr = env("MASTER_ADDR");
  if (!addr) {
    throw UsageError("MASTER_ADDR", "is not set, but " + why,
                     "export MASTER_ADDR=<host of the store> (torchrun sets it for you)");
  }
  info.master_addr = *addr;
  info.master_port = env_required_int(env, "MASTER_PORT", why);
  // Division by zero would crash before validate() could explain: guard the defaults.
  const int per_node = info.local_world_size > 0 ? info.local_world_size : 1;
  info.group_rank = env_int(env, "GROUP_RANK").value_or(info.rank / per_node);
  info.group_world_size = env_int(env, "GROUP_WORLD_SIZE").value_or(info.world_size / per_node);
  info.role_rank = env_int(env, "ROLE_RANK").value_or(info.rank);
  info.role_world_size = env_int(env, "ROLE_WORLD_SIZE").value_or(info.world_size);
  info.restart_count = env_int(env, "TORCHELASTIC_RESTART_COUNT").value_or(0);
  info.max_restarts = env_int(env, "TORCHELASTIC_MAX_RESTARTS").value_or(0);
  info.run_id = env("TORCHELASTIC_RUN_ID").value_or("");
  info.use_agent_store = env_bool(env, "TORCHELASTIC_USE_AGENT_STORE").value_or(false);
  // END SOLUTION
  return info;
}

LaunchInfo parse_mpi(const EnvLookup& env) {
  LaunchInfo info;
  info.launcher = Launcher::kMpi;
  const std::string why = "OMPI_COMM_WORLD_RANK is set (mpirun sets them together)";
  // BEGIN SOLUTION: every field from mpirun's four variables: the node and the node count come
  //   from the ranks (header: not from NODE_RANK), the store address as the header says
  //   (L04ParseMpi.*; hints: README section 9)
  info.rank = env_required_int(env, "OMPI_COMM_WORLD_RANK", why);
  info.world_size = env_required_int(env, "OMPI_COMM_WORLD_SIZE", why);
  info.local_rank = env_required_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", why);
  info.local_world_size = env_required_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", why);
  const int per_node = info.local_world_size > 0 ? info.local_world_size : 1;
  info.group_rank = info.rank / per_node;  // by slot: node 0 is filled first
  info.group_world_size = (info.world_size + per_node - 1) / per_node;
  info.role_rank = info.rank;
  info.role_world_size = info.world_size;
  info.master_addr = env("MASTER_ADDR").value_or("127.0.0.1");
  info.master_port = env_int(env, "MASTER_PORT").value_or(29500);
  // END SOLUTION
  return info;
}

void validate(const LaunchInfo& info) {
  const std::string rank = var_name(info.launcher, Var::kRank);
  const std::string world = var_name(info.launcher, Var::kWorldSize);
  const std::string local_rank = var_name(info.launcher, Var::kLocalRank);
  const std::string local_world = var_name(info.launcher, Var::kLocalWorldSize);
  // BEGIN SOLUTION: the first of the header's nine rules that fails throws a UsageError whose
  //   subject is the variable at fault, as info.launcher spells it; if none fails, return
  //   (L04Validate.*; hints: README section 9)
  if (info.world_size < 1) {
    throw UsageError(world, fmt::format("{} is not a positive number of ranks", info.world_size),
                     fmt::format("{} is the number of processes in the job (nodes x ranks per "
                                 "node); a launcher sets it",
                                 world));
  }
  check_range(rank, info.rank, 0, info.world_size, world);
  if (info.local_world_size < 1 || info.local_world_size > info.world_size) {
    throw UsageError(
        local_world,
        fmt::format("{} does not fit {} {}", info.local_world_size, world, info.world_size),
        fmt::format("{} is the number of ranks on this node: 1..{}", local_world, world));
  }
  check_range(local_rank, info.local_rank, 0, info.local_world_size, local_world);
  if (info.group_world_size < 1) {
    throw UsageError(
        "GROUP_RANK",
        fmt::format("GROUP_WORLD_SIZE {} is not a positive number of nodes", info.group_world_size),
        "GROUP_WORLD_SIZE is the number of nodes; torchrun sets it with GROUP_RANK");
  }
  check_range("GROUP_RANK", info.group_rank, 0, info.group_world_size, "GROUP_WORLD_SIZE");
  check_range("ROLE_RANK", info.role_rank, 0, info.role_world_size, "ROLE_WORLD_SIZE");
  if (info.master_addr.empty()) {
    throw UsageError("MASTER_ADDR", "is empty", "set it to the host name or address of the store");
  }
  if (info.master_port < 1 || info.master_port > 65535) {
    throw UsageError("MASTER_PORT", fmt::format("{} is not a TCP port", info.master_port),
                     "use a port between 1 and 65535, e.g. 29500");
  }
  if (info.restart_count < 0 || info.restart_count > info.max_restarts) {
    throw UsageError(
        "TORCHELASTIC_RESTART_COUNT",
        fmt::format("{} is outside 0..{} (TORCHELASTIC_MAX_RESTARTS is {})", info.restart_count,
                    info.max_restarts, info.max_restarts),
        "torchrun restarts at most --max-restarts times: unset both, or fix the one set by hand");
  }
  // END SOLUTION
}

LaunchInfo read_launch(const EnvLookup& env) {
  // BEGIN SOLUTION: the validated LaunchInfo of whichever launcher started this process; with
  //   none, rank 0 of 1 that still honours MASTER_ADDR / MASTER_PORT (L04ReadLaunch.*)
  LaunchInfo info;
  switch (detect_launcher(env)) {
    case Launcher::kTorchrun: info = parse_torchrun(env); break;
    case Launcher::kMpi: info = parse_mpi(env); break;
    case Launcher::kSlurm:  // not one of this lesson's launchers: detect_launcher never says so
    case Launcher::kNone:
      info.master_addr = env("MASTER_ADDR").value_or(info.master_addr);
      info.master_port = env_int(env, "MASTER_PORT").value_or(info.master_port);
      break;
  }
  validate(info);
  return info;
  // END SOLUTION
}

torch::Device pick_device(const LaunchInfo& info, int cuda_devices) {
  // BEGIN SOLUTION: the CPU when no CUDA device is visible; the only one when one is visible
  //   (a GPU bound to each task); else the GPU that this rank's place on the node owns; a rank
  //   without a GPU is the header's UsageError (L04PickDevice.*)
  if (cuda_devices <= 0) return torch::Device(torch::kCPU);
  if (cuda_devices == 1) return torch::Device(torch::kCUDA, 0);
  if (info.local_rank >= cuda_devices) {
    throw UsageError("LOCAL_RANK",
                     fmt::format("is {}, but this process sees only {} CUDA device(s)",
                                 info.local_rank, cuda_devices),
                     fmt::format("start at most {} ranks per node (--nproc_per_node={}), or check "
                                 "CUDA_VISIBLE_DEVICES",
                                 cuda_devices, cuda_devices));
  }
  // DeviceIndex is a small integer type (int8_t in both LibTorch generations): cast explicitly.
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(info.local_rank));
  // END SOLUTION
}

void require_ranks(const LaunchInfo& info, int min_ranks, const std::vector<std::string>& argv,
                   const std::string& torchrun) {
  // BEGIN SOLUTION: with fewer than min_ranks ranks, the header's UsageError, whose hint is a
  //   torchrun command that, pasted into a shell, starts this same command line on enough ranks
  //   (L04RequireRanks.*; hints: README section 9)
  if (info.world_size >= min_ranks) return;
  const std::string program = argv.empty() ? std::string("the program") : argv.front();
  throw UsageError(
      "WORLD_SIZE",
      fmt::format("{} needs at least {} ranks, but it was started as {} (launcher: {})", program,
                  min_ranks, info.world_size, launcher_name(info.launcher)),
      fmt::format("start it with a launcher:\n  {} --standalone --nproc_per_node={} --no_python {}",
                  torchrun, min_ranks, shell_join(argv)));
  // END SOLUTION
}

std::string torchrun_command(const MultiNodeJob& job, int node) {
  // BEGIN SOLUTION: typed on every node, the commands start one job of hosts x nproc_per_node
  //   ranks, numbered node by node, its store on hosts[0]:port, every rank running the program
  //   as given; static: only the node's own number differs; c10d: one command for every node;
  //   bad input is the header's UsageError (L04Command.*, e2e multinode; hints: README section 9)
  const int nodes = static_cast<int>(job.hosts.size());
  if (nodes == 0) {
    throw UsageError("--hosts", "no host: a job needs at least one node",
                     "list the nodes, the one that serves the store first: --hosts node0,node1");
  }
  if (job.nproc_per_node < 1) {
    throw UsageError(
        "--nproc-per-node",
        fmt::format("is {}, but every node runs at least one rank", job.nproc_per_node),
        "pass the ranks (GPUs) per node, e.g. --nproc-per-node 8");
  }
  if (job.port < 1 || job.port > 65535) {
    throw UsageError("--port", fmt::format("{} is not a TCP port", job.port),
                     "pass a port in 1..65535 that is free on the first host, e.g. --port 29500");
  }
  if (node < 0 || node >= nodes) {
    throw UsageError("--node",
                     fmt::format("node {} is outside 0..{} ({} host(s))", node, nodes - 1, nodes),
                     "number the nodes from 0, in the order of --hosts");
  }
  if (job.program.empty()) {
    throw UsageError(
        "program", "no program to run",
        "put the program and its arguments last, after --, e.g. -- build/bin/lesson06");
  }
  std::string rendezvous;
  if (job.rendezvous == Rendezvous::kStatic) {
    // Static: every node is told its number and where node 0 serves the store.
    rendezvous = fmt::format("--node_rank={} --master_addr={} --master_port={}", node,
                             shell_join({job.hosts[0]}), job.port);
  } else {
    // c10d: the agents meet at the endpoint under one id and number themselves.
    if (job.job_id.empty()) {
      throw UsageError("--job-id", "c10d rendezvous needs a job id, the same on every node",
                       "name the job, e.g. --job-id job42");
    }
    rendezvous = fmt::format("--rdzv_backend=c10d --rdzv_endpoint={} --rdzv_id={}",
                             shell_join({fmt::format("{}:{}", job.hosts[0], job.port)}),
                             shell_join({job.job_id}));
  }
  return fmt::format("{} --nnodes={} --nproc_per_node={} {} --no_python {}", job.torchrun, nodes,
                     job.nproc_per_node, rendezvous, shell_join(job.program));
  // END SOLUTION
}

}  // namespace dtc::l04
