// dtc/cost.h: the alpha-beta model of a ring allreduce, checked against its closed form.
#include <gtest/gtest.h>

#include <stdexcept>
#include <utility>
#include <vector>

#include "dtc/cost.h"

namespace dtc {
namespace {

TEST(Cost, FitRecoversTheModelThatMadeTheTimes) {
  // Closed form: alpha 20 us a step, 5 GB/s a link, 4 ranks: T(S) = 6 alpha + 1.5 S / B.
  AlphaBeta truth;
  truth.alpha_s = 20e-6;
  truth.bandwidth = 5e9;
  std::vector<std::pair<double, double>> points;
  for (double s = 1024; s <= 64.0 * 1024 * 1024; s *= 2) {
    points.emplace_back(s, truth.seconds(s, 4));
  }
  EXPECT_DOUBLE_EQ(truth.seconds(1e6, 4), 6 * 20e-6 + 1.5 * 1e6 / 5e9);
  const AlphaBeta fit = fit_ring_allreduce(points, 4);
  EXPECT_NEAR(fit.alpha_s, 20e-6, 20e-6 * 1e-9);
  EXPECT_NEAR(fit.bandwidth, 5e9, 5e9 * 1e-9);
  // Where 6 alpha = 1.5 S / B: S = alpha W B = 20e-6 * 4 * 5e9 = 400 kB.
  EXPECT_NEAR(fit.crossover_bytes, 400e3, 1e-3);
}

TEST(Cost, FitRefusesWhatIsNotAModel) {
  EXPECT_THROW(fit_ring_allreduce({{1024, 1e-3}, {1024, 2e-3}}, 4), std::invalid_argument);
  EXPECT_THROW(fit_ring_allreduce({{1024, 1e-3}, {2048, 2e-3}}, 1), std::invalid_argument);
  // Times that fall with size: no positive bandwidth.
  EXPECT_THROW(fit_ring_allreduce({{1024, 3e-3}, {4096, 2e-3}, {16384, 1e-3}}, 2),
               std::invalid_argument);
}

}  // namespace
}  // namespace dtc
