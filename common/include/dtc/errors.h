// Errors that tell the reader what was wrong and how to fix it.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace dtc {

/// Bad input from the command line or the environment. Programs exit with code 2 on it.
///
/// what() reads "<subject>: <problem>\nHINT: <fix>", where subject is the flag or variable
/// (e.g. "--tp" or "WORLD_SIZE").
class UsageError : public std::invalid_argument {
 public:
  UsageError(const std::string& subject, const std::string& problem, const std::string& hint)
      : std::invalid_argument(subject + ": " + problem + "\nHINT: " + hint), subject_(subject) {}
  /// The flag or variable at fault, e.g. "--tp".
  const std::string& subject() const { return subject_; }

 private:
  std::string subject_;
};

/// The element of @p items whose `.name` is @p name (presets looked up from a flag).
/// @throws UsageError(flag): "'<name>' is not a known <what>", with a hint that lists every
///   known name, followed by @p more_hint.
template <class T>
const T& find_by_name(const std::vector<T>& items, const std::string& name, const std::string& flag,
                      const std::string& what, const std::string& more_hint) {
  std::string names;
  for (const auto& item : items) {
    if (item.name == name) return item;
    names += (names.empty() ? "" : ", ") + item.name;
  }
  throw UsageError(flag, "'" + name + "' is not a known " + what,
                   "use one of: " + names + "; " + more_hint);
}

}  // namespace dtc
