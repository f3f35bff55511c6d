// Lesson 11's program: flags, run, report. What it runs (the mesh, the rank's model, the step)
// is in nd.h.
#pragma once

#include <iosfwd>

#include "nd.h"

namespace dtc::l11 {

/// Runs `lesson11` with @p argv on this process's rank (torchrun's environment); prints on
/// @p out (rank 0), progress and errors on @p err.
/// @return the exit code: 0, 2 for bad input, 3 while a TODO(L11) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

/// run_program(argc, argv, std::cout, std::cerr): what main.cpp calls.
int run_main(int argc, char** argv);

}  // namespace dtc::l11
