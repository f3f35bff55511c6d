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
  // TODO(L04)
  DTC_TODO("L04",
           "the launcher whose variables are set (torchrun's win over mpirun's); with "
           "neither, a stray torchrun variable is a UsageError naming it, in the header's order "
           "(L04Detect.*; hints: README section 9)");
}

LaunchInfo parse_torchrun(const EnvLookup& env) {
  LaunchInfo info;
  info.launcher = Launcher::kTorchrun;
  const std::string why = "RANK is set (torchrun sets them together)";
  // TODO(L04)
  DTC_TODO("L04",
           "every field from torchrun's variables: the six required ones must be set, "
           "the others take the header's defaults, and LOCAL_WORLD_SIZE=0 must reach validate(), "
           "not "
           "a division by zero (L04ParseTorchrun.*; hints: README section 9)");
  return info;
}

LaunchInfo parse_mpi(const EnvLookup& env) {
  LaunchInfo info;
  info.launcher = Launcher::kMpi;
  const std::string why = "OMPI_COMM_WORLD_RANK is set (mpirun sets them together)";
  // TODO(L04)
  DTC_TODO("L04",
           "every field from mpirun's four variables: the node and the node count come "
           "from the ranks (header: not from NODE_RANK), the store address as the header says "
           "(L04ParseMpi.*; hints: README section 9)");
  return info;
}

void validate(const LaunchInfo& info) {
  const std::string rank = var_name(info.launcher, Var::kRank);
  const std::string world = var_name(info.launcher, Var::kWorldSize);
  const std::string local_rank = var_name(info.launcher, Var::kLocalRank);
  const std::string local_world = var_name(info.launcher, Var::kLocalWorldSize);
  // TODO(L04)
  DTC_TODO("L04",
           "the first of the header's nine rules that fails throws a UsageError whose "
           "subject is the variable at fault, as info.launcher spells it; if none fails, return "
           "(L04Validate.*; hints: README section 9)");
}

LaunchInfo read_launch(const EnvLookup& env) {
  // TODO(L04)
  DTC_TODO("L04",
           "the validated LaunchInfo of whichever launcher started this process; with "
           "none, rank 0 of 1 that still honours MASTER_ADDR / MASTER_PORT (L04ReadLaunch.*)");
}

torch::Device pick_device(const LaunchInfo& info, int cuda_devices) {
  // TODO(L04)
  DTC_TODO("L04",
           "the CPU when no CUDA device is visible; the only one when one is visible "
           "(a GPU bound to each task); else the GPU that this rank's place on the node owns; a "
           "rank "
           "without a GPU is the header's UsageError (L04PickDevice.*)");
}

void require_ranks(const LaunchInfo& info, int min_ranks, const std::vector<std::string>& argv,
                   const std::string& torchrun) {
  // TODO(L04)
  DTC_TODO("L04",
           "with fewer than min_ranks ranks, the header's UsageError, whose hint is a "
           "torchrun command that, pasted into a shell, starts this same command line on enough "
           "ranks "
           "(L04RequireRanks.*; hints: README section 9)");
}

std::string torchrun_command(const MultiNodeJob& job, int node) {
  // TODO(L04)
  DTC_TODO("L04",
           "typed on every node, the commands start one job of hosts x nproc_per_node "
           "ranks, numbered node by node, its store on hosts[0]:port, every rank running the "
           "program "
           "as given; static: only the node's own number differs; c10d: one command for every "
           "node; "
           "bad input is the header's UsageError (L04Command.*, e2e multinode; hints: README "
           "section 9)");
}

}  // namespace dtc::l04
// generated from solutions/04_launch/launch_env.cpp; checksum 0aa9751b820db4f2
