// dtc::source_path (dtc/data.h), alone in its file: the checkout's path is compiled into it, so
// it differs in every clone, and a file that includes LibTorch would miss the compiler cache
// there. This one includes none (a tenth of a second to compile).
#include <string>

#ifndef DTC_SOURCE_DIR
#error "DTC_SOURCE_DIR must name the course's source tree (common/CMakeLists.txt sets it)"
#endif

namespace dtc {

std::string source_path(const std::string& relative) {
  return std::string(DTC_SOURCE_DIR) + "/" + relative;
}

}  // namespace dtc
