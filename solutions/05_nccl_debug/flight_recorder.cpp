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
  // BEGIN SOLUTION: each rank's last enqueued and completed sequence numbers for pg_id; the
  //   first one not completed everywhere; who never called it, who waits in it, what each
  //   called there, and whether they agree (L05FlightRecorder.*; hints: README section 7)
  struct Progress {
    long long enqueued = 0, completed = 0;
    nlohmann::json entries;
  };
  if (dumps.empty()) throw std::invalid_argument("no dump: give every rank's");
  std::map<int, Progress> ranks;
  for (const auto& d : dumps) {
    if (ranks.count(d.rank)) {
      throw std::invalid_argument(
          fmt::format("rank {} has two dumps: give each rank's once", d.rank));
    }
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(d.json);
    } catch (const nlohmann::json::exception& e) {
      throw std::invalid_argument(fmt::format(
          "rank {}'s dump is not JSON ({}): dump_fr_trace_json() writes JSON", d.rank, e.what()));
    }
    if (!j.is_object() || !j.contains("pg_status")) {
      throw std::invalid_argument(fmt::format(
          "rank {}'s dump has no \"pg_status\": is it a Flight Recorder dump?", d.rank));
    }
    Progress p;
    const auto& status = j.at("pg_status");
    if (status.contains(pg_id)) {
      try {
        p.enqueued = counter(status.at(pg_id), "last_enqueued_collective");
        p.completed = counter(status.at(pg_id), "last_completed_collective");
      } catch (const std::exception& e) {
        throw std::invalid_argument(
            fmt::format("rank {}'s pg_status counters are not numbers ({})", d.rank, e.what()));
      }
    }
    p.entries = j.value("entries", nlohmann::json::array());
    ranks.emplace(d.rank, std::move(p));
  }
  FrVerdict v;
  long long most_enqueued = 0, least_completed = -1;
  for (const auto& [rank, p] : ranks) {
    most_enqueued = std::max(most_enqueued, p.enqueued);
    least_completed = least_completed < 0 ? p.completed : std::min(least_completed, p.completed);
  }
  if (ranks.empty() || std::all_of(ranks.begin(), ranks.end(), [&](const auto& r) {
        return r.second.completed == most_enqueued;
      })) {
    v.all_completed = true;
    return v;
  }
  v.seq = least_completed + 1;
  std::set<std::string> distinct;
  for (const auto& [rank, p] : ranks) {
    if (p.enqueued < v.seq) {
      v.missing.push_back(rank);
      continue;
    }
    if (p.completed < v.seq) v.waiting.push_back(rank);
    std::string call = "?";
    for (const auto& e : p.entries) {
      if (std::to_string(e.value("pg_id", -1)) == pg_id && !e.value("is_p2p", false) &&
          e.value("collective_seq_id", -1LL) == v.seq) {
        call = call_of(e);
        break;
      }
    }
    v.calls[rank] = call;
    if (call != "?") distinct.insert(call);  // an evicted entry disagrees with nothing
  }
  v.mismatch = distinct.size() > 1;
  return v;
  // END SOLUTION
}

}  // namespace dtc::l05
