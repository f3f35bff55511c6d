// The bf16 tolerance policy of the parallel lessons (lesson 02's README, section 11, applied to
// tensor and pipeline parallelism): rho = |w - r| / |r - w0| on the fp32 (master) weights, the
// noise floor rho(bf16 baseline, fp32 baseline), and a run held within a bound of the floor from
// the single-process bf16 baseline and at least kAwayFromFp32 of it from the fp32 baseline.
//
//   test::RhoSums sums;                      // on each rank, over its own pieces of the model
//   sums.add(w[i], bf16_piece, fp32_piece, w0_piece);
//   test::expect_bf16_policy(total, floor, test::kOtherRounding, losses, bf16.losses, "the TP
//   run");
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "dtc/compare.h"
#include "dtc/model.h"
#include "dtc_test.h"

namespace dtc::test {

/// Another bf16 rounding of the same training (partial sums rounded before an allreduce,
/// gradients accumulated over micro-batches): lesson 02's bound for PyTorch's autocast.
inline constexpr double kOtherRounding = 1.5;
/// How far from the fp32 baseline a bf16 run must be, at least, so that fp32 training fails.
inline constexpr double kAwayFromFp32 = 0.25;

/// rho's squared distances, summed over pieces (shards, stages) that hold each weight once.
struct RhoSums {
  double to_bf16 = 0, bf16_moved = 0, to_fp32 = 0, fp32_moved = 0;
  /// One piece: @p w the run's, @p bf16 and @p fp32 the baselines' same piece, @p w0 the start.
  void add(const torch::Tensor& w, const torch::Tensor& bf16, const torch::Tensor& fp32,
           const torch::Tensor& w0) {
    to_bf16 += (w - bf16).pow(2).sum().item<double>();
    bf16_moved += (bf16 - w0).pow(2).sum().item<double>();
    to_fp32 += (w - fp32).pow(2).sum().item<double>();
    fp32_moved += (fp32 - w0).pow(2).sum().item<double>();
  }
  void add(const RhoSums& o) {
    to_bf16 += o.to_bf16;
    bf16_moved += o.bf16_moved;
    to_fp32 += o.to_fp32;
    fp32_moved += o.fp32_moved;
  }
  double rho_bf16() const { return std::sqrt(to_bf16 / bf16_moved); }
  double rho_fp32() const { return std::sqrt(to_fp32 / fp32_moved); }
};

/// A GPT of @p config holding @p weights (parameters() order), to cut shards or stages from.
inline Gpt gpt_with(const GptConfig& config, const std::vector<torch::Tensor>& weights) {
  Gpt g(config);
  torch::NoGradGuard no_grad;
  const auto ps = g->parameters();
  for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(weights[i]);
  return g;
}

/// Checks a run's summed distances against the policy (@p bound times @p floor from the bf16
/// baseline, kAwayFromFp32 of it from fp32) and its losses against the bf16 baseline's within
/// kHalfStepsVsPyTorch; prints the measured rhos. @p what names the run in the messages.
inline void expect_bf16_policy(const RhoSums& sums, double floor, double bound,
                               const std::vector<float>& losses,
                               const std::vector<float>& bf16_losses, const std::string& what) {
  std::cout << "    rho to bf16 baseline " << sums.rho_bf16() << ", to fp32 " << sums.rho_fp32()
            << ", floor " << floor << "\n";
  EXPECT_GT(floor, 0.0);
  EXPECT_LE(sums.rho_bf16(), bound * floor)
      << what << "'s master weights are not the bf16 baseline's";
  EXPECT_GE(sums.rho_fp32(), kAwayFromFp32 * floor) << what << " trained in fp32, not bf16";
  EXPECT_TENSOR_CLOSE(torch::tensor(losses), torch::tensor(bf16_losses), kHalfStepsVsPyTorch);
}

}  // namespace dtc::test
