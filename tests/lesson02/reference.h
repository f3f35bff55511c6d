// Lesson 02 tests: the PyTorch reference values, and the configurations they were made with.
// tests/reference/lesson02_reference.py computes them with PyTorch (see that script).
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "baseline.h"
#include "dtc/data.h"
#include "plain_baseline.h"

namespace dtc::l02::test {

/// A reference file (e.g. "lesson02_reference.json"), parsed: the one this machine's PyTorch
/// computed in the build folder (BUILD/reference/, above BUILD/tests/ or BUILD/tests/mutants/
/// where the test programs are: lessons/02_baseline/lesson.cmake makes those whose values
/// depend on the CPU) when there is one, else the committed one under tests/reference/.
inline nlohmann::json read_reference(const std::string& file) {
  std::error_code ec;
  std::string path = source_path("tests/reference/" + file);
  auto dir = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path();
  for (int up = 0; !ec && up < 3 && !dir.empty(); ++up, dir = dir.parent_path()) {
    const auto built = dir / "reference" / file;
    if (std::filesystem::exists(built, ec)) {
      path = built.string();
      break;
    }
  }
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  return nlohmann::json::parse(in);
}

/// tests/reference/lesson02_reference.json, read once.
inline const nlohmann::json& reference() {
  static const nlohmann::json j = read_reference("lesson02_reference.json");
  return j;
}

/// One case of the reference ("tiny_tied", "tiny_untied").
inline const nlohmann::json& reference_case(const std::string& name) {
  return reference().at("cases").at(name);
}

/// The TrainConfig that a reference case was computed with.
inline TrainConfig config_of(const nlohmann::json& c) { return ::dtc::test::run_config_of(c); }

/// Lesson 01's GPT parameter count (its section 4; REFERENCES.md "GPT-2 style"):
/// L(12h^2 + 13h) + Vh + ctx*h + 2h, plus Vh for an untied output head.
inline int64_t gpt_params(const GptConfig& m) {
  const int64_t h = m.hidden;
  return m.layers * (12 * h * h + 13 * h) + m.vocab * h + m.ctx * h + 2 * h +
         (m.tied ? 0 : m.vocab * h);
}

}  // namespace dtc::l02::test
