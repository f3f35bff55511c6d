// Lesson 04's program, as a function so that tests can run it in-process.
#pragma once

#include <iosfwd>

#include "dtc/launch.h"

namespace dtc::l04 {

/// Runs `lesson04` with @p argv in the environment @p env: reads and checks the launch
/// environment (your launch_env.cpp), joins the job, and has rank 0 print every rank's place in
/// it and an allreduce whose sum is known in closed form. Rank 0 writes to @p out; every rank
/// writes its own line, and errors, to @p err.
/// @return the exit code: 0; 1 for a runtime failure (or --crash-rank); 2 for bad input (a flag
///   or a launch variable: the message names it and the fix); 3 while a TODO(L04) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
                const EnvLookup& env = process_env);

/// run_program(argc, argv, std::cout, std::cerr): what main.cpp calls.
int run_main(int argc, char** argv);

}  // namespace dtc::l04
