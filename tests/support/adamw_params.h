// Comparing parameters trained by AdamW against a baseline, with the one tolerance fp32 forces.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>

#include "dtc/compare.h"

namespace dtc::test {

/// Parameters after @p steps AdamW steps at learning rate @p lr, against the baseline's.
///
/// AdamW's update m / (sqrt(v) + eps) is ill-conditioned where a gradient is near eps (a
/// parameter whose gradient is all but zero): there a reordered fp32 sum (another BLAS, another
/// split of the batch, another thread count) moves the element by a fraction of lr, in any
/// direction. Measured: Debian's libtorch on OpenBLAS, lesson 07's untied stage 0: 1 of 134,912
/// elements off by 1.7e-5; lesson 06's bucketed DDP on 3 ranks in a loaded fresh root: 1 of 96
/// (a bias near zero, -7.6e-6 against 4.5e-6). So every element must be within kFp32Steps,
/// except at most 1 in 10,000 (at least 1), each of which must still be within 5% of what AdamW
/// can move an element in these steps (steps x lr). A wrong shard, scale or order moves many
/// elements, or one by far more.
inline ::testing::AssertionResult adamw_params_close(const char* got_expr, const char*, const char*,
                                                     const char*, const torch::Tensor& got,
                                                     const torch::Tensor& expected, int64_t steps,
                                                     double lr) {
  const Comparison strict = compare_tensors(got, expected, kFp32Steps, got_expr);
  if (strict.ok) return ::testing::AssertionSuccess();
  if (got.sizes() != expected.sizes()) return ::testing::AssertionFailure() << strict.message;
  const auto g = got.detach().to(torch::kDouble).flatten();
  const auto e = expected.detach().to(torch::kDouble).flatten();
  const auto outside = (g - e).abs() > kFp32Steps.atol + kFp32Steps.rtol * e.abs();
  const int64_t n_outside = outside.sum().item<int64_t>();
  const int64_t allowed = std::max<int64_t>(1, g.numel() / 10000);
  const Tolerance near_eps{0.0, 0.05 * static_cast<double>(steps) * lr,
                           "AdamW near eps: <= 5% of steps x lr"};
  const Comparison loose = compare_tensors(got, expected, near_eps, got_expr);
  if (n_outside <= allowed && loose.ok) return ::testing::AssertionSuccess();
  std::ostringstream m;
  m << got_expr << ": " << n_outside << " of " << g.numel() << " elements outside "
    << kFp32Steps.why << " (at most " << allowed
    << " may be, near AdamW's eps, by <= 5% of steps x lr)\n"
    << (loose.ok ? strict.message : loose.message);
  return ::testing::AssertionFailure() << m.str();
}

}  // namespace dtc::test

/// EXPECT that parameters trained for @p steps AdamW steps at learning rate @p lr match the
/// baseline's (see dtc::test::adamw_params_close for the tolerance and why).
#define EXPECT_ADAMW_PARAMS_CLOSE(got, expected, steps, lr) \
  EXPECT_PRED_FORMAT4(::dtc::test::adamw_params_close, got, expected, steps, lr)
