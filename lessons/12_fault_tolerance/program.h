// Lesson 12's program: flags, resume, train with checkpoints, report. What it saves and how is in
// checkpoint.h and state.h.
#pragma once

#include <iosfwd>

namespace dtc::l12 {

/// Runs `lesson12` with @p argv on this process's rank (torchrun's environment); prints on
/// @p out (rank 0), progress and errors on @p err.
/// @return the exit code: 0, 2 for bad input, 3 while a TODO(L12) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

/// run_program(argc, argv, std::cout, std::cerr): what main.cpp calls.
int run_main(int argc, char** argv);

}  // namespace dtc::l12
