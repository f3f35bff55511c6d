// Running a lesson's program in-process, as its tests do: argv in, exit code and output out.
#pragma once

#include <nlohmann/json.hpp>

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

/// The JSON object on the last line of @p out (the shared --json convention).
inline nlohmann::json last_json_line(const std::string& out) {
  const auto end = out.find_last_not_of('\n');
  const auto start = out.rfind('\n', end);
  return nlohmann::json::parse(out.substr(start == std::string::npos ? 0 : start + 1));
}

}  // namespace dtc::test
