// Lesson 03's program, as functions so that tests can run it in-process: run_program() reads the
// launch environment and the flags and connects the ranks; run_demo() is what every rank does
// once connected (the tests call it on thread-ranks).
#pragma once

#include <chrono>
#include <cstdint>
#include <iosfwd>

#include "dtc/compat.h"
#include "dtc/launch.h"

namespace dtc::l03 {

/// What the lesson03 program does, from its flags.
struct DemoOptions {
  int tp = 1;               ///< tensor-parallel degree of the rank grid (--tp)
  int pp = 1;               ///< pipeline-parallel degree (--pp); dp is world / (tp * pp)
  int64_t numel = 1000003;  ///< elements of the ring allreduce (--numel): a prime, so uneven
  uint64_t seed = 1;        ///< seeds the ring allreduce's random inputs (--seed)
  bool json = false;        ///< rank 0 prints one JSON object instead of the tables (--json)
  std::chrono::milliseconds timeout{std::chrono::seconds(30)};  ///< per collective (--timeout)
};

/// Runs the tour, the rank grid and the ring allreduce on an initialised job. Every rank calls
/// it; rank 0 prints the report on @p out (the others print nothing).
/// @param env this rank's launch environment (only rank, local_rank, group_rank are read)
/// @param store the job's store; @param world the communicator over all ranks
/// @return 0 when every result on every rank matched its closed form, 1 otherwise
/// @throws UsageError for a grid that does not fit the world size
int run_demo(const DemoOptions& options, const LaunchEnv& env,
             const c10::intrusive_ptr<c10d::Store>& store, Comm& world, std::ostream& out);

/// Runs `lesson03` with @p argv: needs at least 2 ranks (started by torchrun or mpirun).
/// @return the exit code: 0, 1 when a result is wrong, 2 for bad input (a flag, the launch
///   environment, or no launcher: the message shows the exact torchrun command), 3 while a
///   TODO(L03) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
                const EnvLookup& env = process_env);

/// run_program(argc, argv, std::cout, std::cerr): what main.cpp calls.
int run_main(int argc, char** argv);

}  // namespace dtc::l03
