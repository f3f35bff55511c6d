// Lesson 08 tests, part 1: Megatron's conjugate operators f (copy_to_tp) and g (reduce_from_tp)
// on 2 and 4 thread-ranks. Expected values in closed form: rank r contributes r + 1, so a sum
// over W ranks is W(W+1)/2.
#include <gtest/gtest.h>

#include <chrono>

#include "dtc/compare.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "tensor_parallel.h"

namespace dtc::l08 {
namespace {

using test::kTimeout;

class L08Ops : public ::testing::TestWithParam<int> {};

TEST_P(L08Ops, CopyToTpIsIdentityForwardAndSumBackward) {
  const int W = GetParam();
  run_ranks(
      W,
      [](RankContext& ctx) {
        const torch::Tensor x = torch::arange(6, torch::kFloat).requires_grad_();
        const torch::Tensor y = copy_to_tp(x, *ctx.comm);
        EXPECT_TENSOR_CLOSE(y.detach(), torch::arange(6, torch::kFloat), kExact);
        // Rank r's upstream gradient is r + 1: f's backward sums them over the group.
        (y * static_cast<float>(ctx.rank + 1)).sum().backward();
        ASSERT_TRUE(x.grad().defined()) << "copy_to_tp must pass the gradient back to its input";
        const float sum = static_cast<float>(ctx.world * (ctx.world + 1) / 2);
        EXPECT_TENSOR_CLOSE(x.grad(), torch::full({6}, sum), kExact);
      },
      kTimeout);
}

TEST_P(L08Ops, ReduceFromTpIsSumForwardAndIdentityBackward) {
  const int W = GetParam();
  run_ranks(
      W,
      [](RankContext& ctx) {
        const torch::Tensor x = torch::full({5}, static_cast<float>(ctx.rank + 1)).requires_grad_();
        const torch::Tensor y = reduce_from_tp(x, *ctx.comm);
        const float sum = static_cast<float>(ctx.world * (ctx.world + 1) / 2);
        EXPECT_TENSOR_CLOSE(y.detach(), torch::full({5}, sum), kExact);
        EXPECT_TENSOR_CLOSE(x.detach(), torch::full({5}, static_cast<float>(ctx.rank + 1)),
                            kExact);  // g must not modify its input
        (y * 3.0f).sum().backward();
        ASSERT_TRUE(x.grad().defined()) << "reduce_from_tp must pass the gradient back";
        EXPECT_TENSOR_CLOSE(x.grad(), torch::full({5}, 3.0f), kExact);
      },
      kTimeout);
}

INSTANTIATE_TEST_SUITE_P(Ranks, L08Ops, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

}  // namespace
}  // namespace dtc::l08
