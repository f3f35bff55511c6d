// The stub that stands in for every unfinished exercise region.
//
// Exercise files are generated from the solutions (scripts/exercises.py): each
// `// BEGIN SOLUTION: hint` ... `// END SOLUTION` region becomes
//
//   // TODO(L01): hint
//   DTC_TODO("L01", "hint");
//
// which throws dtc::TodoError naming the lesson, the function, the file and line and the hint.
// An untouched exercise therefore fails its tests loudly; it never returns a silent default.
#pragma once

#include <stdexcept>
#include <string>

namespace dtc {

/// Thrown by DTC_TODO: an exercise region that the learner has not written yet.
class TodoError : public std::logic_error {
 public:
  TodoError(std::string lesson, std::string hint, const std::string& message)
      : std::logic_error(message), lesson_(std::move(lesson)), hint_(std::move(hint)) {}
  /// The lesson tag, e.g. "L01".
  const std::string& lesson() const { return lesson_; }
  /// The one-line hint that the solution's author wrote for this region.
  const std::string& hint() const { return hint_; }

 private:
  std::string lesson_;
  std::string hint_;
};

/// Throws TodoError. Use through DTC_TODO, which fills in the location.
[[noreturn]] void todo(const char* lesson, const char* hint, const char* function, const char* file,
                       int line);

}  // namespace dtc

/// Marks an unfinished exercise region: throws dtc::TodoError with the lesson, function and hint.
#define DTC_TODO(lesson, hint) \
  ::dtc::todo((lesson), (hint), __PRETTY_FUNCTION__, __FILE__, __LINE__)
