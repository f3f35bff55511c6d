#include "dtc/todo.h"

#include <fmt/format.h>

namespace dtc {

void todo(const char* lesson, const char* hint, const char* function, const char* file, int line) {
  throw TodoError(lesson, hint,
                  fmt::format("TODO({}) not done yet: {}\n  at {}:{}\n  HINT: {}", lesson, function,
                              file, line, hint));
}

}  // namespace dtc
