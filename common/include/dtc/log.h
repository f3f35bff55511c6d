// Rank-0 logging: side work (logs, progress, checkpoints) is done by one rank only; the others
// would print the same line N times.
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <utility>

namespace dtc {

/// Prints to stderr on rank 0 only, prefixed with "[rank 0] ".
class RankLog {
 public:
  explicit RankLog(int rank, std::FILE* out = stderr) : rank_(rank), out_(out) {}

  /// Formats with fmt and prints one line, on rank 0 only.
  template <typename... Args>
  void operator()(fmt::format_string<Args...> format, Args&&... args) const {
    if (rank_ != 0) return;
    fmt::print(out_, "[rank 0] {}\n", fmt::format(format, std::forward<Args>(args)...));
    std::fflush(out_);
  }

  /// Prints on every rank, prefixed with its rank (for what differs between ranks).
  template <typename... Args>
  void all(fmt::format_string<Args...> format, Args&&... args) const {
    fmt::print(out_, "[rank {}] {}\n", rank_, fmt::format(format, std::forward<Args>(args)...));
    std::fflush(out_);
  }

 private:
  int rank_;
  std::FILE* out_;
};

}  // namespace dtc
