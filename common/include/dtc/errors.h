// Errors that tell the reader what was wrong and how to fix it.
#pragma once

#include <stdexcept>
#include <string>

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

}  // namespace dtc
