// The alpha-beta model of a ring allreduce, and its fit (dtc/cost.h).
#include "dtc/cost.h"

#include <set>
#include <stdexcept>
#include <string>

namespace dtc {

double AlphaBeta::seconds(double bytes, int world) const {
  const double steps = 2.0 * (world - 1);
  return steps * alpha_s + steps / world * bytes / bandwidth;
}

AlphaBeta fit_ring_allreduce(const std::vector<std::pair<double, double>>& bytes_seconds,
                             int world) {
  if (world < 2) throw std::invalid_argument("fit_ring_allreduce: needs at least 2 ranks");
  std::set<double> sizes;
  for (const auto& p : bytes_seconds) sizes.insert(p.first);
  if (sizes.size() < 2) {
    throw std::invalid_argument("fit_ring_allreduce: needs at least two different sizes");
  }
  // Weighted least squares of T = a + b S with weights 1/T^2.
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [s, t] : bytes_seconds) {
    const double w = 1.0 / (t * t);
    sw += w;
    sx += w * s;
    sy += w * t;
    sxx += w * s * s;
    sxy += w * s * t;
  }
  const double b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx);
  const double a = (sy - b * sx) / sw;
  if (!(a > 0) || !(b > 0)) {
    throw std::invalid_argument("fit_ring_allreduce: the times give latency " + std::to_string(a) +
                                " s and " + std::to_string(b) +
                                " s/byte; both must be positive (do the times grow with size?)");
  }
  const double steps = 2.0 * (world - 1);
  AlphaBeta m;
  m.alpha_s = a / steps;
  m.bandwidth = steps / world / b;
  m.crossover_bytes = m.alpha_s * world * m.bandwidth;
  return m;
}

}  // namespace dtc
