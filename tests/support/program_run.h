// Running a lesson's program in-process, as its tests do: argv in, exit code and output out.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>

#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace dtc::test {

/// What a program run gave back.
struct ProgramRun {
  int code;
  std::string out;
  std::string err;
};

/// Calls @p entry(argc, argv, out, err) with argv = {name, args...} and captures both streams.
template <class Entry>
ProgramRun run_in_process(const std::string& name, std::vector<std::string> args, Entry&& entry) {
  args.insert(args.begin(), name);
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int code = std::forward<Entry>(entry)(static_cast<int>(argv.size()), argv.data(), out, err);
  return {code, out.str(), err.str()};
}

/// Removes the launchers' variables (torchrun's, Open MPI's), so that a program run in-process is
/// one rank whatever launched the test binary.
inline void clear_launch_env() {
  for (const char* v :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"}) {
    ::unsetenv(v);
  }
}

/// One bad command line and the flag its error must name.
using BadInput = std::pair<std::vector<std::string>, const char*>;

/// Each of @p cases must exit 2 (a usage error) with a message that names its flag and a
/// "HINT: " line that says how to fix it, and no LibTorch backtrace.
template <class Entry>
void expect_usage_errors(const std::string& name, const std::vector<BadInput>& cases,
                         Entry&& entry) {
  for (const auto& [args, flag] : cases) {
    SCOPED_TRACE(std::string(flag));
    const ProgramRun r = run_in_process(name, args, entry);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_NE(r.err.find(flag), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("HINT: "), std::string::npos) << "no fix-it hint:\n" << r.err;
    EXPECT_EQ(r.err.find("Exception raised from"), std::string::npos) << r.err;
  }
}

/// The JSON object on the last line of @p out (the shared --json convention).
inline nlohmann::json last_json_line(const std::string& out) {
  const auto end = out.find_last_not_of('\n');
  const auto start = out.rfind('\n', end);
  return nlohmann::json::parse(out.substr(start == std::string::npos ? 0 : start + 1));
}

}  // namespace dtc::test
