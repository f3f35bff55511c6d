// Lesson 01's program, as a function so that tests can run it in-process.
#pragma once

#include <iosfwd>

namespace dtc::l01 {

/// Runs `lesson01` with @p argv; prints the ledger on @p out and errors on @p err.
/// @return the exit code: 0, 2 for bad input (the message names the flag and the fix),
///   3 while a TODO(L01) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

/// run_program(argc, argv, std::cout, std::cerr): what main.cpp calls.
int run_main(int argc, char** argv);

}  // namespace dtc::l01
