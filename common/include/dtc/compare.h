// Comparing tensors, with the course's tolerance policy written down in one place.
//
// A result is close when |got - expected| <= atol + rtol * |expected| elementwise (the rule of
// torch.testing.assert_close). The named tolerances below are the only ones tests use; each
// says what it is for. Defaults per dtype are torch.testing.assert_close's:
// float32 rtol 1.3e-6 / atol 1e-5, float16 1e-3 / 1e-5, bfloat16 1.6e-2 / 1e-5.
#pragma once

#include <string>

#include "dtc/compat.h"

namespace dtc {

/// An elementwise tolerance: |got - expected| <= atol + rtol * |expected|.
struct Tolerance {
  double rtol;
  double atol;
  const char* why;  ///< printed with a failure: which rule this is
};

/// Bit-for-bit: integer data, copies, broadcasts, checkpoint round trips.
inline constexpr Tolerance kExact{0.0, 0.0, "exact: no arithmetic happened"};
/// One fp32 operation whose summation order may differ (an allreduce, a matmul split by rank):
/// torch.testing.assert_close's float32 default.
inline constexpr Tolerance kFp32Op{1.3e-6, 1e-5, "fp32, one op (assert_close default)"};
/// A few fp32 training steps compared across strategies (DDP, ZeRO, TP, PP vs the baseline):
/// reordered sums compound through forward, backward and the optimizer.
inline constexpr Tolerance kFp32Steps{1e-4, 1e-5, "fp32, several training steps"};
/// Against PyTorch's own run of the same computation (different kernels, same maths).
inline constexpr Tolerance kFp32VsPyTorch{1e-4, 1e-5, "fp32, LibTorch vs PyTorch reference"};
/// One bfloat16 operation: assert_close's bfloat16 default.
inline constexpr Tolerance kBf16Op{1.6e-2, 1e-5, "bf16, one op (assert_close default)"};
/// Losses of a few bf16/fp16 training steps against PyTorch's run of the same scheme (16-bit
/// weights, fp32 master weights): lesson 02's half-precision policy (its README, section 11).
inline constexpr Tolerance kHalfStepsVsPyTorch{1e-3, 1e-3,
                                               "bf16/fp16 steps, same scheme in PyTorch"};

/// The result of compare_tensors(): ok, or a message "got / expected / max diff".
struct Comparison {
  bool ok = true;
  std::string message;
};

/// Compares shapes, dtypes and values. On a mismatch the message names @p what, the shape,
/// the worst element's index, its got / expected values and the max abs and rel differences.
Comparison compare_tensors(const at::Tensor& got, const at::Tensor& expected, const Tolerance& tol,
                           const std::string& what = "tensor");

}  // namespace dtc
