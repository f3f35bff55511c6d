// Assertions whose failures read "got X, expected Y (source)".
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <sstream>
#include <string>

namespace dtc::test {

// Constants several test files of a lesson share. Each lesson's tests are compiled as one
// translation unit (DTC_UNITY_TESTS): a file takes these with `using test::kTimeout;`, which may
// repeat, instead of defining its own copy, which may not.

/// A collective that waits longer than this in a thread-rank test has lost its peer: the test
/// fails within seconds instead of hanging.
inline constexpr std::chrono::milliseconds kTimeout{3000};
/// The world sizes a thread-rank test tries: even, odd, and a power of two above two.
inline constexpr int kWorlds[] = {2, 3, 4};
/// Bytes in a (decimal) gigabyte, as the memory tables print them.
inline constexpr double kGB = 1e9;

/// |got - expected| <= rel * |expected|, with the source of the expected value in the message.
inline ::testing::AssertionResult close_rel(const char* got_expr, const char* /*expected_expr*/,
                                            const char* /*rel_expr*/, const char* /*src_expr*/,
                                            double got, double expected, double rel,
                                            const std::string& source) {
  const double diff = std::fabs(got - expected);
  if (diff <= rel * std::fabs(expected)) return ::testing::AssertionSuccess();
  std::ostringstream m;
  m.precision(12);
  m << got_expr << ": got " << got << ", expected " << expected << " (" << source
    << "); relative difference " << diff / std::fabs(expected) << " > tolerance " << rel;
  return ::testing::AssertionFailure() << m.str();
}

}  // namespace dtc::test

/// EXPECT that got is within relative tolerance rel of expected; source names where expected
/// comes from (a paper and table, or "closed form: ...").
#define EXPECT_CLOSE_REL(got, expected, rel, source) \
  EXPECT_PRED_FORMAT4(::dtc::test::close_rel, got, expected, rel, source)

/// EXPECT that the tensors match within a dtc::Tolerance (see dtc/compare.h).
#define EXPECT_TENSOR_CLOSE(got, expected, tol)                             \
  do {                                                                      \
    auto dtc_cmp_ = ::dtc::compare_tensors((got), (expected), (tol), #got); \
    EXPECT_TRUE(dtc_cmp_.ok) << dtc_cmp_.message;                           \
  } while (0)
