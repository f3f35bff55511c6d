// Lesson 05's program, as a function so that tests can run it in-process.
#pragma once

#include <iosfwd>

#include "dtc/launch.h"

namespace dtc::l05 {

/// Runs `lesson05 <subcommand>` with @p argv:
///   doctor              checks the environment and the machine (exit 0 ok, 1 warning, 2 error)
///   fault --case C      the fault lab: breaks a run on purpose and prints "DIAGNOSIS: ..."
///   nccl-log FILE...    summarises NCCL_DEBUG=INFO logs
///   nccl-log FILE --link A B   the transport from rank A to B and why (exit 0 healthy, 1 not)
///   interfaces [--cluster IF]  what NCCL_SOCKET_IFNAME selects here (exit 1: not just IF)
///   fr-analyze FILE...  lines up the ranks' Flight Recorder dumps (exit 1: something is stuck)
///   (none)              a healthy run: the barrier and two checked collectives on every rank
/// @return the exit code: 0 ok; 1 a runtime failure, or a fault diagnosed (the run did break);
///   2 bad input (or doctor errors); 3 while a TODO(L05) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
                const EnvLookup& env = process_env);

/// run_program(argc, argv, std::cout, std::cerr): what main.cpp calls.
int run_main(int argc, char** argv);

}  // namespace dtc::l05
