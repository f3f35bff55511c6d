// Lesson 04 contract: read the launch environment, check it, and pick this rank's device.
//
// A launcher (torchrun, mpirun, Slurm's srun) starts N copies of one program and tells each
// copy who it is through environment variables. This header is the whole specification of what
// you implement in launch_env.cpp; README.md beside it teaches every variable. Build and test:
//
//   make test-lesson04          # your exercise, test by test
//   make run-lesson04           # the program on 2 ranks, under torchrun
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "dtc/launch.h"
#include "env_vars.h"

namespace dtc::l04 {

/// Everything a rank learns from its launcher. The fields of dtc::LaunchEnv (launcher, rank,
/// local_rank, world_size, local_world_size, group_rank, master_addr, master_port,
/// use_agent_store, restart_count, max_restarts, run_id) plus the rest of what torchrun sets.
/// A LaunchInfo is a LaunchEnv, so it goes straight into dtc::init_distributed().
struct LaunchInfo : LaunchEnv {
  int group_world_size = 1;  ///< GROUP_WORLD_SIZE: the number of nodes (agents) in the job
  int role_rank = 0;         ///< ROLE_RANK: rank among the workers of the same role
  int role_world_size = 1;   ///< ROLE_WORLD_SIZE: workers of that role (torchrun: one role)
};

// ---------------------------------------------------------------------------------------------
// Reading the environment (yours)
// ---------------------------------------------------------------------------------------------

/// Which launcher started this process, from the variables it left.
///
/// RANK set: torchrun (or anything that follows its convention, e.g. a Slurm script that
/// exports RANK). Else OMPI_COMM_WORLD_RANK set: OpenMPI's mpirun. Else no launcher, unless a
/// stray torchrun variable says otherwise.
/// @param env the environment (dtc::process_env for the real one)
/// @return Launcher::kTorchrun, Launcher::kMpi or Launcher::kNone
/// @throws UsageError(name) when RANK is unset but one of WORLD_SIZE, LOCAL_RANK,
///   LOCAL_WORLD_SIZE, GROUP_RANK is set (checked in that order): a half-set environment, most
///   often a variable left exported in the shell. The hint says to launch with torchrun or
///   unset it.
Launcher detect_launcher(const EnvLookup& env);

/// Reads torchrun's variables. Parses only: validate() checks that they fit together.
///
/// Required (torchrun always sets them): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
/// MASTER_ADDR, MASTER_PORT. Optional, with the default when unset:
///   GROUP_RANK                    rank / LOCAL_WORLD_SIZE
///   GROUP_WORLD_SIZE              WORLD_SIZE / LOCAL_WORLD_SIZE
///   ROLE_RANK, ROLE_WORLD_SIZE    RANK, WORLD_SIZE
///   TORCHELASTIC_RESTART_COUNT    0
///   TORCHELASTIC_MAX_RESTARTS     0
///   TORCHELASTIC_RUN_ID           ""
///   TORCHELASTIC_USE_AGENT_STORE  false (an env_bool: True/true/1 or False/false/0)
/// @return a LaunchInfo with launcher = Launcher::kTorchrun
/// @throws UsageError(name) for a required variable that is unset (env_required_int's message)
///   or any variable that does not parse (env_int's, env_bool's).
LaunchInfo parse_torchrun(const EnvLookup& env);

/// Reads OpenMPI's variables (mpirun -np N). Parses only: validate() checks them.
///
/// Required: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
/// OMPI_COMM_WORLD_LOCAL_SIZE (mpirun sets all four). Then:
///   group_rank        rank / local size (mpirun fills node 0 first: ranks are by slot). Do NOT
///                     use OMPI_COMM_WORLD_NODE_RANK: despite its name it counts processes on
///                     the node (it is 1 for the second rank of a one-node job), not nodes.
///                     The limit: under `mpirun --map-by node` (round robin over nodes) rank 1
///                     is on node 1, and rank / local size is not the node; only comparing host
///                     names across ranks (an allgather) is right for every mapping. The
///                     course uses group_rank for reports only.
///   group_world_size  ceil(size / local size)
///   role_rank, role_world_size   rank, size
///   master_addr, master_port     MASTER_ADDR and MASTER_PORT when set, else 127.0.0.1 and
///                                29500 (mpirun does not pick a store address: pass it with
///                                `mpirun -x MASTER_ADDR=... -x MASTER_PORT=...`)
/// @return a LaunchInfo with launcher = Launcher::kMpi
/// @throws UsageError(name) as parse_torchrun does.
LaunchInfo parse_mpi(const EnvLookup& env);

/// Checks that a parsed LaunchInfo describes a possible rank, in this order; the first
/// violated rule throws UsageError whose subject is the variable at fault, named as @p
/// info.launcher spells it (var_name(): WORLD_SIZE for torchrun, OMPI_COMM_WORLD_SIZE for mpirun):
///   1. world_size >= 1                                   subject: world size's name
///   2. 0 <= rank < world_size                            rank's name
///   3. 1 <= local_world_size <= world_size               local world size's name
///   4. 0 <= local_rank < local_world_size                local rank's name
///   5. group_world_size >= 1 and 0 <= group_rank < group_world_size       "GROUP_RANK"
///   6. 0 <= role_rank < role_world_size                  "ROLE_RANK"
///   7. master_addr not empty                             "MASTER_ADDR"
///   8. 1 <= master_port <= 65535                         "MASTER_PORT"
///   9. 0 <= restart_count <= max_restarts                "TORCHELASTIC_RESTART_COUNT"
///      (a restart count above the maximum is two variables that disagree)
/// A range message reads "<value> is outside 0..<hi-1> (<other name> is <hi>)", e.g.
/// "RANK: 4 is outside 0..3 (WORLD_SIZE is 4)".
/// @throws UsageError as above; returns normally when every rule holds.
void validate(const LaunchInfo& info);

/// The launch environment of this process: detect_launcher(), then parse_torchrun() or
/// parse_mpi() and validate(); with no launcher, a single rank (rank 0 of 1, everything at its
/// default, launcher kNone) whose MASTER_ADDR and MASTER_PORT are taken from the environment
/// when set (and validated too).
/// @throws UsageError from the functions it calls.
LaunchInfo read_launch(const EnvLookup& env = process_env);

/// The device this rank computes on: one GPU per rank, chosen by its rank on the node.
/// @param info this rank's launch environment
/// @param cuda_devices how many CUDA devices this process sees (torch::cuda::device_count());
///   0 on a CPU-only machine or a CPU build of LibTorch
/// @return torch::kCPU when @p cuda_devices is 0; cuda:0 when it is 1, whatever the local rank
///   (the scheduler bound one GPU to each task: `srun --gpus-per-task=1`, or a
///   CUDA_VISIBLE_DEVICES with one entry per process); else cuda:<local_rank>
/// @throws UsageError("LOCAL_RANK") when local_rank >= cuda_devices > 1: more ranks on this
///   node than GPUs it sees; the hint says to start at most cuda_devices ranks per node
///   (--nproc_per_node=<cuda_devices>) or check CUDA_VISIBLE_DEVICES.
torch::Device pick_device(const LaunchInfo& info, int cuda_devices);

/// Stops a program that needs at least @p min_ranks ranks but was started with fewer, with the
/// exact command that starts it correctly.
/// @param info this rank's launch environment
/// @param min_ranks the fewest ranks the program can run with
/// @param argv the program's own command line (argv[0] first), as it was started
/// @param torchrun how torchrun is started on this machine, with the flags it needs here,
///   e.g. "torchrun" or "torchrun --redirects 2 --tee 2"
/// @throws UsageError("WORLD_SIZE") when info.world_size < min_ranks. Its problem reads
///   "<argv[0]> needs at least <min_ranks> ranks, but it was started as <world_size> (launcher:
///   <launcher_name>)"; its hint is "start it with a launcher:\n  " followed by the command
///   `<torchrun> --standalone --nproc_per_node=<min_ranks> --no_python <shell_join(argv)>`.
void require_ranks(const LaunchInfo& info, int min_ranks, const std::vector<std::string>& argv,
                   const std::string& torchrun);

// ---------------------------------------------------------------------------------------------
// Writing the launch command of a multi-node job (yours)
// ---------------------------------------------------------------------------------------------

/// How the nodes of a job find each other (README section 7).
enum class Rendezvous {
  kStatic,  ///< torchrun's default: you number the nodes; node 0 serves the store
  kC10d,    ///< c10d rendezvous: the agents number themselves in order of arrival
};

/// A multi-node job, as the person who starts it knows it.
struct MultiNodeJob {
  std::vector<std::string> hosts;  ///< one address (or host name) per node; hosts[0] serves
                                   ///< the job's store (static) or rendezvous (c10d)
  int nproc_per_node = 1;          ///< ranks on each node (its GPUs)
  int port = 29500;                ///< the port of that store on hosts[0]
  std::string job_id = "job";      ///< the job's name (c10d's rendezvous id)
  Rendezvous rendezvous = Rendezvous::kStatic;
  std::vector<std::string> program;   ///< what every rank runs: the program, then its arguments
  std::string torchrun = "torchrun";  ///< how torchrun is started here (may carry flags)
};

/// The command to type on node @p node of @p job.
///
/// Contract, checked by torchrun itself (the end-to-end tests parse every command with
/// torchrun's own argument parser, then run them, one torchrun per node): typed on every node,
/// the commands start one job of hosts.size() * nproc_per_node ranks, numbered node by node;
/// every rank runs exactly @p job.program (no Python interpreter in front of it), its arguments
/// arriving unchanged through a POSIX shell whatever characters they hold. With
/// Rendezvous::kStatic the command for hosts[k] makes that node node k (GROUP_RANK k), node 0
/// serves the job's store at hosts[0]:port, and two nodes' commands differ only where the node's
/// own number is written. With kC10d every node types the same command: the agents meet at the
/// rendezvous served on hosts[0]:port under job_id and number themselves in order of arrival
/// (the job's store is then served by whichever agent became node 0). The command starts with
/// @p job.torchrun as given, and spells torchrun's options with underscores
/// (--nproc_per_node), the only spelling torchrun 1.13 reads; 2.x reads both. No
/// --standalone: it means one node.
/// @throws UsageError("--hosts") when there is no host; UsageError("--nproc-per-node") when
///   nproc_per_node < 1; UsageError("--port") outside 1..65535; UsageError("--node") when
///   @p node is not in 0..hosts.size()-1; UsageError("--job-id") for an empty job id with
///   kC10d; UsageError("program") when @p job.program is empty. Each hint says what to pass
///   instead.
std::string torchrun_command(const MultiNodeJob& job, int node);

}  // namespace dtc::l04
