// Lesson 13's program: flags, train the MoE GPT with expert parallelism, report.
#pragma once

#include <iosfwd>

namespace dtc::l13 {

/// Runs `lesson13` with @p argv on this process's rank (torchrun's environment); prints on
/// @p out (rank 0), progress and errors on @p err.
/// @return the exit code: 0, 2 for bad input, 3 while a TODO(L13) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

/// run_program(argc, argv, std::cout, std::cerr): what main.cpp calls.
int run_main(int argc, char** argv);

}  // namespace dtc::l13
