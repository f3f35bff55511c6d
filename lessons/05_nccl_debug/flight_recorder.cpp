// Lesson 05, your third part: lining up the ranks' Flight Recorder dumps (contract:
// flight_recorder.h).
//   make test-lesson05
// nlohmann::json parses a dump: json::parse(text), j.at("pg_status"), j.value("key", default),
// j.contains("key"), and range-for over j.at("entries").
#include "flight_recorder.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "dtc/todo.h"

namespace dtc::l05 {
namespace {

// (maybe_unused: the untouched exercise does not call these helpers yet.)
// A pg_status counter: a string ("2", "-1") in PyTorch's dumps; absent or negative counts as 0.
[[maybe_unused]] long long counter(const nlohmann::json& status, const char* key) {
  if (!status.contains(key)) return 0;
  const auto& v = status.at(key);
  const long long n = v.is_string() ? std::stoll(v.get<std::string>()) : v.get<long long>();
  return std::max(n, 0LL);
}

// "gloo:all_reduce(Float[4, 8], Long[2])": an entry's op and inputs.
[[maybe_unused]] std::string call_of(const nlohmann::json& entry) {
  std::string inputs;
  const auto sizes = entry.value("input_sizes", nlohmann::json::array());
  const auto dtypes = entry.value("input_dtypes", nlohmann::json::array());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::string dims;
    for (const auto& d : sizes[i])
      dims += (dims.empty() ? "" : ", ") + std::to_string(d.get<long long>());
    inputs += fmt::format("{}{}[{}]", i ? ", " : "",
                          i < dtypes.size() ? dtypes[i].get<std::string>() : "?", dims);
  }
  return fmt::format("{}({})", entry.value("profiling_name", std::string("?")), inputs);
}

}  // namespace

FrVerdict analyze_flight_recorder(const std::vector<FrDump>& dumps, const std::string& pg_id) {
  // TODO(L05)
  DTC_TODO("L05",
           "each rank's last enqueued and completed sequence numbers for pg_id; the "
           "first one not completed everywhere; who never called it, who waits in it, what each "
           "called there, and whether they agree (L05FlightRecorder.*; hints: README section 7)");
}

}  // namespace dtc::l05
// generated from solutions/05_nccl_debug/flight_recorder.cpp; checksum ab6cd1b44fbfde88
