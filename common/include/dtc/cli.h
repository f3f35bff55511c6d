// The command line shared by the course's programs (CLI11), and their exit codes.
//
// Every training program from lesson 02 on takes the same flags, so that lessons can be
// compared run for run:
//   --steps N  --seed S  --global-batch B  --json  [--backend gloo|nccl]
// With --json, rank 0 prints one JSON object on the last line of stdout with at least
// "losses" (one per step) and "tokens_per_s".
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

namespace dtc {

/// Exit codes of the course's programs.
enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,  ///< a runtime failure (I/O, communication, ...)
  kExitUsage = 2,    ///< bad input: a flag or an environment variable; the message says which
  kExitTodo = 3,     ///< an exercise region is not written yet (TODO(LNN))
};

/// The flags that every training program shares.
struct TrainFlags {
  int64_t steps = 20;            ///< optimizer steps to run
  uint64_t seed = 1;             ///< seeds weights and data: same seed, same run
  int64_t global_batch = 8;      ///< sequences per optimizer step, summed over all ranks
  bool json = false;             ///< print one JSON object on the last line of stdout (rank 0)
  std::string backend = "gloo";  ///< collectives: gloo (CPU) or nccl (CUDA builds, GPU nodes)
};

/// Adds --steps, --seed, --global-batch, --json and --backend to @p app, bound to @p flags.
void add_train_flags(CLI::App& app, TrainFlags& flags);

// CLI11 validators whose messages say how to fix the value (CLI11 puts the flag's name first).

/// A whole number >= 1, e.g. positive_count("--layers 4").
CLI::Validator positive_count(const std::string& example);

/// A whole number >= 0, e.g. non_negative_count("--epoch-windows 0").
CLI::Validator non_negative_count(const std::string& example);

/// A finite number > 0 (CLI::PositiveNumber also lets inf and nan through), e.g.
/// finite_positive("--lr 3e-3").
CLI::Validator finite_positive(const std::string& example);

/// One of @p values, e.g. one_of({"naive", "flat", "bucketed"}, "how gradients are averaged").
CLI::Validator one_of(std::vector<std::string> values, const std::string& what);

/// A path that names a readable file, e.g. readable_file("pass a checkpoint written by --save").
CLI::Validator readable_file(const std::string& hint);

/// Accepts a path to an existing directory; otherwise names the path and @p hint.
CLI::Validator existing_directory(const std::string& hint);

/// Accepts a directory this process can write files in, creating it (and its parents) when it
/// does not exist yet; otherwise names the path, the reason, and @p hint. It writes and removes
/// one empty probe file there.
CLI::Validator writable_directory(const std::string& hint);

/// Parses the command line and runs @p body, turning every error into a clear message and an
/// exit code: CLI11's parse errors and UsageError -> 2, TodoError -> 3, other exceptions -> 1.
/// --help prints the usage and returns 0.
int run_cli(CLI::App& app, int argc, const char* const* argv, const std::function<int()>& body,
            std::ostream& err);

/// Prints @p object as one line of JSON (the last line a program prints with --json).
void print_json_line(std::ostream& out, const nlohmann::json& object);

}  // namespace dtc
