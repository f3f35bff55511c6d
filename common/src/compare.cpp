#include "dtc/compare.h"

#include <fmt/format.h>

#include <sstream>

namespace dtc {
namespace {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

}  // namespace

Comparison compare_tensors(const at::Tensor& got, const at::Tensor& expected, const Tolerance& tol,
                           const std::string& what) {
  Comparison out;
  if (!got.defined() || !expected.defined()) {
    out.ok = false;
    out.message = fmt::format("{}: got {} tensor, expected {} tensor", what,
                              got.defined() ? "a" : "an undefined",
                              expected.defined() ? "a" : "an undefined");
    return out;
  }
  if (got.sizes() != expected.sizes()) {
    out.ok = false;
    out.message =
        fmt::format("{}: shape got {}, expected {}", what, shape_str(got), shape_str(expected));
    return out;
  }
  if (got.scalar_type() != expected.scalar_type()) {
    out.ok = false;
    out.message =
        fmt::format("{}: dtype got {}, expected {}", what, c10::toString(got.scalar_type()),
                    c10::toString(expected.scalar_type()));
    return out;
  }
  if (got.numel() == 0) return out;
  auto g = got.detach().to(torch::kCPU, torch::kFloat64).flatten();
  auto e = expected.detach().to(torch::kCPU, torch::kFloat64).flatten();
  auto diff = (g - e).abs();
  auto allowed = tol.atol + tol.rtol * e.abs();
  auto excess = diff - allowed;
  // NaN in either tensor is a mismatch unless both are NaN at the same place.
  auto nan_mismatch = g.isnan().logical_xor(e.isnan());
  const bool bad_nan = nan_mismatch.any().item<bool>();
  excess = torch::where(g.isnan().logical_and(e.isnan()), torch::full_like(excess, -1.0), excess);
  const int64_t worst = bad_nan ? nan_mismatch.to(torch::kInt64).argmax().item<int64_t>()
                                : excess.argmax().item<int64_t>();
  if (!bad_nan && excess[worst].item<double>() <= 0) return out;
  const int64_t n_bad =
      bad_nan ? nan_mismatch.sum().item<int64_t>() : (excess > 0).sum().item<int64_t>();
  const double max_abs = diff.nan_to_num(0.0).max().item<double>();
  const double max_rel = (diff / e.abs().clamp_min(1e-30)).nan_to_num(0.0).max().item<double>();
  out.ok = false;
  out.message = fmt::format(
      "{} {} differs in {} of {} elements (tolerance: rtol {:g}, atol {:g}; {})\n"
      "  worst at flat index {}: got {:.9g}, expected {:.9g}\n"
      "  max abs diff {:.3g}, max rel diff {:.3g}",
      what, shape_str(got), n_bad, got.numel(), tol.rtol, tol.atol, tol.why, worst,
      g[worst].item<double>(), e[worst].item<double>(), max_abs, max_rel);
  return out;
}

}  // namespace dtc
