// Comparing two parameter digests (dtc/digest.h) from runs that differ only in fp32 rounding.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <string>

namespace dtc::test {

/// Two param_digest()s (arrays of {name, numel, sum, sumsq}): the same names in the same order,
/// the same sizes, and sums and sums of squares within 1e-4 relative (+ 1e-4 absolute), what a
/// few fp32 AdamW steps computed in another order leave.
inline void expect_digest_close(const nlohmann::json& got, const nlohmann::json& want) {
  ASSERT_EQ(got.size(), want.size()) << got.dump() << "\n" << want.dump();
  for (size_t i = 0; i < want.size(); ++i) {
    const std::string name = want[i].at("name");
    EXPECT_EQ(got[i].at("name"), name);
    EXPECT_EQ(got[i].at("numel"), want[i].at("numel")) << name;
    for (const char* key : {"sum", "sumsq"}) {
      const double w = want[i].at(key).get<double>();
      EXPECT_NEAR(got[i].at(key).get<double>(), w, 1e-4 * (1 + std::abs(w))) << name << " " << key;
    }
  }
}

}  // namespace dtc::test
