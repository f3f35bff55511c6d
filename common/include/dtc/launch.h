// The launch environment: who am I, how many of us are there, and where is the store.
//
// Four launchers are understood, in this order of precedence:
//   torchrun  RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
//             GROUP_RANK, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_USE_AGENT_STORE, ...
//   mpirun    OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE (OpenMPI);
//             MASTER_ADDR / MASTER_PORT default to 127.0.0.1:29500 when unset
//   srun      a task of a Slurm job step (srun's SLURM_PROCID, SLURM_STEP_NUM_TASKS,
//             SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_TASKS_PER_NODE); MASTER_ADDR and
//             MASTER_PORT must be exported when the step spans several nodes. A batch script
//             itself is not a task: it has SLURM_PROCID=0 but no SLURM_STEP_NUM_TASKS, and runs
//             as a single rank
//   none      a single rank (rank 0 of 1)
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace dtc {

/// Which launcher started this process.
enum class Launcher { kNone, kTorchrun, kMpi, kSlurm };

/// "none", "torchrun", "mpirun" or "srun".
const char* launcher_name(Launcher launcher);

/// Everything a rank needs to know about its place in the job.
struct LaunchEnv {
  Launcher launcher = Launcher::kNone;
  int rank = 0;                           ///< global rank, 0 .. world_size-1
  int local_rank = 0;                     ///< rank on this node: picks the device
  int world_size = 1;                     ///< number of ranks in the job
  int local_world_size = 1;               ///< ranks on this node
  int group_rank = 0;                     ///< node index (torchrun's GROUP_RANK, SLURM_NODEID)
  std::string master_addr = "127.0.0.1";  ///< where the TCPStore lives
  int master_port = 29500;                ///< its port
  /// torchrun's agent already hosts the store at MASTER_ADDR:MASTER_PORT: every rank,
  /// rank 0 included, connects as a client (TORCHELASTIC_USE_AGENT_STORE=True).
  bool use_agent_store = false;
  int restart_count = 0;  ///< TORCHELASTIC_RESTART_COUNT: scopes store keys after a restart
  int max_restarts = 0;   ///< TORCHELASTIC_MAX_RESTARTS
  std::string run_id;     ///< TORCHELASTIC_RUN_ID

  /// True when this rank hosts the TCPStore (rank 0, unless the agent hosts it).
  bool hosts_store() const { return rank == 0 && !use_agent_store; }
  /// Prefix for every store key of this attempt, e.g. "attempt0/": keys that an earlier,
  /// failed attempt left in the agent's store are never read again.
  std::string store_prefix() const;
  /// One line for logs: "rank 1/4 (local 1/2, node 0) via torchrun, store 10.0.0.1:29500".
  std::string describe() const;
};

/// Looks up one environment variable; returns nullopt when it is unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

/// The real process environment.
std::optional<std::string> process_env(const std::string& name);

/// Reads and validates the launch environment.
/// @throws UsageError naming the variable and the fix: a variable that is not an integer,
///   a rank outside the world, a torchrun variable set without the others, and so on.
LaunchEnv read_launch_env(const EnvLookup& env = process_env);

/// The generation (major version) of the torchrun that launched this process, read from the
/// variables only that generation sets: torchrun 2.x sets TORCHELASTIC_SIGNALS_TO_HANDLE and
/// TORCH_NCCL_ASYNC_ERROR_HANDLING, torchrun 1.x (Debian's 1.13) sets NCCL_ASYNC_ERROR_HANDLING
/// and neither of the others. nullopt when not under torchrun's agent store (1.13's torchrun
/// sets TORCHELASTIC_USE_AGENT_STORE=False: rank 0 hosts the store), or unsure.
std::optional<int> torchrun_generation(const EnvLookup& env = process_env);

/// Stops a program whose LibTorch (major version @p torch_major) cannot talk to the store of
/// the torchrun that launched it: the TCPStore protocols of 1.x and 2.x differ, and the first
/// contact ends in a "Socket Timeout" after the full store timeout. @p torchrun_cmd is the
/// torchrun that goes with this build, for the hint.
/// @throws UsageError naming both generations and the torchrun to use instead.
void check_torchrun_generation(int torch_major, const std::string& torchrun_cmd,
                               const EnvLookup& env = process_env);

/// Stops a program that needs at least @p min_world ranks but was started with fewer.
/// @throws UsageError whose hint is the exact torchrun command to run instead.
void require_world_size(const LaunchEnv& env, int min_world, const std::string& program);

}  // namespace dtc
