// Lesson 10's program: flags, run, report. The given pieces it runs (the mesh, the training
// loop, memory and volume) are in context_parallel_given.h.
#pragma once

#include <iosfwd>

#include "context_parallel_given.h"

namespace dtc::l10 {

/// Runs `lesson10` with @p argv on this process's rank (torchrun's environment); prints on
/// @p out (rank 0), progress and errors on @p err.
/// @return the exit code: 0, 2 for bad input, 3 while a TODO(L10) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

/// run_program(argc, argv, std::cout, std::cerr): what main.cpp calls.
int run_main(int argc, char** argv);

}  // namespace dtc::l10
