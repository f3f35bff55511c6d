// Lesson 05, given in full: describe() of a Flight Recorder verdict (contract: flight_recorder.h).
#include <fmt/format.h>

#include "debug_aids.h"  // join_ranks
#include "flight_recorder.h"

namespace dtc::l05 {

std::string describe(const FrVerdict& v) {
  if (v.all_completed) return "every rank completed every collective it enqueued: nothing is stuck";
  if (v.mismatch) {
    std::string text = fmt::format("collective #{} differs across ranks:", v.seq);
    const char* sep = " ";
    for (const auto& [rank, call] : v.calls) {
      text += fmt::format("{}rank {} {}", sep, rank, call);
      sep = "; ";
    }
    if (!v.missing.empty())
      text += fmt::format("; rank(s) {} never called it", join_ranks(v.missing));
    return text;
  }
  std::string call = v.calls.empty() ? "?" : v.calls.begin()->second;
  std::string text = fmt::format("collective #{}", v.seq);
  if (!v.missing.empty())
    text += fmt::format(": rank(s) {} never called it", join_ranks(v.missing));
  if (!v.waiting.empty()) {
    text += fmt::format("{} rank(s) {} wait in {}", v.missing.empty() ? ":" : ";",
                        join_ranks(v.waiting), call);
  }
  return text;
}

}  // namespace dtc::l05
