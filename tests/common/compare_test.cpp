// Tensor comparison and its messages.
#include <gtest/gtest.h>

#include "dtc/compare.h"

namespace dtc {
namespace {

TEST(Compare, WithinTolerance) {
  auto a = torch::tensor({1.0f, 2.0f, 3.0f});
  EXPECT_TRUE(compare_tensors(a, a.clone(), kExact).ok);
  EXPECT_TRUE(compare_tensors(a + 1e-6, a, kFp32Op).ok);
  EXPECT_FALSE(compare_tensors(a + 1e-3, a, kFp32Op).ok);
}

TEST(Compare, MessageSaysGotExpectedAndMaxDiff) {
  auto expected = torch::tensor({1.0f, 2.0f, 3.0f});
  auto got = expected.clone();
  got[1] = 2.5f;
  const Comparison c = compare_tensors(got, expected, kFp32Op, "grad");
  ASSERT_FALSE(c.ok);
  EXPECT_NE(c.message.find("grad"), std::string::npos) << c.message;
  EXPECT_NE(c.message.find("got 2.5"), std::string::npos) << c.message;
  EXPECT_NE(c.message.find("expected 2"), std::string::npos) << c.message;
  EXPECT_NE(c.message.find("max abs diff 0.5"), std::string::npos) << c.message;
  EXPECT_NE(c.message.find("1 of 3"), std::string::npos) << c.message;
}

TEST(Compare, ShapeDtypeAndNan) {
  EXPECT_FALSE(compare_tensors(torch::zeros({2}), torch::zeros({3}), kExact).ok);
  EXPECT_FALSE(compare_tensors(torch::zeros({2}), torch::zeros({2}, torch::kFloat64), kExact).ok);
  auto nan = torch::tensor({std::nanf("")});
  EXPECT_TRUE(compare_tensors(nan, nan.clone(), kExact).ok) << "NaN where NaN is expected";
  EXPECT_FALSE(compare_tensors(nan, torch::zeros({1}), kFp32Op).ok);
}

}  // namespace
}  // namespace dtc
