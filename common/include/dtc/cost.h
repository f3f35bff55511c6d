// The alpha-beta cost model of a collective (Hockney's model, as in Thakur, Rabenseifner and
// Gropp, "Optimization of Collective Communication Operations in MPICH", 2005), for the ring
// allreduce of lesson 03: 2(W - 1) steps, each a latency alpha plus S/W bytes at bandwidth B,
//
//   T(S) = 2(W - 1) alpha + 2(W - 1)/W * S / B,
//
// and its fit to measured times. Plain C++ (the core layer).
#pragma once

#include <utility>
#include <vector>

namespace dtc {

/// A ring allreduce's alpha-beta parameters.
struct AlphaBeta {
  double alpha_s = 0;    ///< latency of one ring step, seconds
  double bandwidth = 0;  ///< bytes per second each link carries
  /// The size where the latency term equals the bandwidth term: alpha W B bytes. Smaller
  /// allreduces are latency-bound (why NCCL switches to trees, NVLS or PAT for them).
  double crossover_bytes = 0;

  /// T(S) for @p bytes on @p world ranks.
  double seconds(double bytes, int world) const;
};

/// Fits T(S) = a + b S to (bytes, seconds) points by least squares on the relative error (each
/// point weighted 1/T^2, so that 1 KiB and 64 MiB count alike), then reads alpha = a / (2(W-1))
/// and B = 2(W-1)/W / b.
/// @throws std::invalid_argument for fewer than two distinct sizes, @p world < 2, or a fit whose
///   latency or bandwidth is not positive (times that do not grow with size)
AlphaBeta fit_ring_allreduce(const std::vector<std::pair<double, double>>& bytes_seconds,
                             int world);

}  // namespace dtc
