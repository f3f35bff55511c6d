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
  // TODO(L04): RANK means torchrun, OMPI_COMM_WORLD_RANK means mpirun; with neither, any
  //   of WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK is a stray variable: throw
  DTC_TODO("L04", "RANK means torchrun, OMPI_COMM_WORLD_RANK means mpirun; with neither, any "
                  "of WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK is a stray variable: throw");
}

LaunchInfo parse_torchrun(const EnvLookup& env) {
  LaunchInfo info;
  info.launcher = Launcher::kTorchrun;
  const std::string why = "RANK is set (torchrun sets them together)";
  // TODO(L04): read the six required variables with env_required_int (MASTER_ADDR is a
  //   string), then the optional ones with their defaults (header)
  DTC_TODO("L04", "read the six required variables with env_required_int (MASTER_ADDR is a "
                  "string), then the optional ones with their defaults (header)");
  return info;
}

LaunchInfo parse_mpi(const EnvLookup& env) {
  LaunchInfo info;
  info.launcher = Launcher::kMpi;
  const std::string why = "OMPI_COMM_WORLD_RANK is set (mpirun sets them together)";
  // TODO(L04): read the four OMPI_COMM_WORLD_* variables, derive the node from rank / local
  //   size, and take MASTER_ADDR / MASTER_PORT when set (else 127.0.0.1:29500)
  DTC_TODO("L04", "read the four OMPI_COMM_WORLD_* variables, derive the node from rank / local "
                  "size, and take MASTER_ADDR / MASTER_PORT when set (else 127.0.0.1:29500)");
  return info;
}

void validate(const LaunchInfo& info) {
  const std::string rank = var_name(info.launcher, Var::kRank);
  const std::string world = var_name(info.launcher, Var::kWorldSize);
  const std::string local_rank = var_name(info.launcher, Var::kLocalRank);
  const std::string local_world = var_name(info.launcher, Var::kLocalWorldSize);
  // TODO(L04): check the nine rules of the header, in order, each with a UsageError that
  //   names the variable at fault (check_range above writes the range message)
  DTC_TODO("L04", "check the nine rules of the header, in order, each with a UsageError that "
                  "names the variable at fault (check_range above writes the range message)");
}

LaunchInfo read_launch(const EnvLookup& env) {
  // TODO(L04): detect the launcher, parse its variables, validate; with no launcher,
  //   a single rank that still honours MASTER_ADDR / MASTER_PORT
  DTC_TODO("L04", "detect the launcher, parse its variables, validate; with no launcher, "
                  "a single rank that still honours MASTER_ADDR / MASTER_PORT");
}

torch::Device pick_device(const LaunchInfo& info, int cuda_devices) {
  // TODO(L04): CPU without CUDA; else cuda:<local_rank>, or a UsageError when this node
  //   runs more ranks than it has GPUs
  DTC_TODO("L04", "CPU without CUDA; else cuda:<local_rank>, or a UsageError when this node "
                  "runs more ranks than it has GPUs");
}

void require_ranks(const LaunchInfo& info, int min_ranks, const std::vector<std::string>& argv,
                   const std::string& torchrun) {
  // TODO(L04): when world_size < min_ranks, throw the UsageError of the header, whose hint
  //   is the exact torchrun command (shell_join the program's own argv)
  DTC_TODO("L04", "when world_size < min_ranks, throw the UsageError of the header, whose hint "
                  "is the exact torchrun command (shell_join the program's own argv)");
}

}  // namespace dtc::l04
// exercise generated from solutions/04_launch/launch_env.cpp by scripts/exercises.py; checksum e0e4e0516e1be7ca
