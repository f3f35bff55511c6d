// Lesson 05, your part: the "who is missing" barrier and collective fingerprinting, both through
// the store (contract: debug_aids.h).
//   make test-lesson05
// Both poll the store with check() and a deadline: a blocking get() or wait() on a key that a
// dead rank will never write is exactly the hang these aids exist to replace.
#include <algorithm>
#include <stdexcept>
#include <thread>

#include "debug_aids.h"
#include "dtc/todo.h"

namespace dtc::l05 {
namespace {

// (maybe_unused: the untouched exercise does not call these helpers yet.)
using Clock = std::chrono::steady_clock;
[[maybe_unused]] constexpr auto kPoll = std::chrono::milliseconds(5);

// The ranks in [0, world) whose key (key_of(r)) is not in the store yet, ascending.
template <class KeyOf>
[[maybe_unused]] std::vector<int> absent(c10d::Store& store, int world, const KeyOf& key_of) {
  std::vector<int> out;
  for (int r = 0; r < world; ++r) {
    if (!store.check({key_of(r)})) out.push_back(r);
  }
  return out;
}

// Polls until every key is present (returns {}) or the deadline passes (returns who is absent).
template <class KeyOf>
[[maybe_unused]] std::vector<int> wait_all(c10d::Store& store, int world, const KeyOf& key_of,
                                           Clock::time_point deadline) {
  while (true) {
    auto missing = absent(store, world, key_of);
    if (missing.empty() || Clock::now() >= deadline) return missing;
    std::this_thread::sleep_for(kPoll);
  }
}

[[maybe_unused]] std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

void barrier_with_report(c10d::Store& store, const std::string& name, int rank, int world,
                         std::chrono::milliseconds timeout) {
  // TODO(L05)
  DTC_TODO("L05",
           "announce this rank and return once all world ranks have; by the timeout, throw "
           "MissingRanksError naming exactly the absent ones, never blocking past it; a rank "
           "outside "
           "[0, world) is std::invalid_argument (L05Barrier.*; hints: README section 5)");
}

void check_fingerprint(c10d::Store& store, int rank, int world, const Fingerprint& mine,
                       std::chrono::milliseconds timeout) {
  // TODO(L05)
  DTC_TODO("L05",
           "publish mine; return only when all world ranks published the same call as "
           "their collective mine.seq, else throw MissingRanksError (absent at the timeout) or "
           "CollectiveMismatchError (ranks grouped by call) (L05Fingerprint.*; hints: README "
           "section 5)");
}

}  // namespace dtc::l05
// generated from solutions/05_nccl_debug/debug_aids.cpp; checksum 5cfe6df95a54fcdc
