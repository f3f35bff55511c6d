// Lesson 10, part 5: Megatron's sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198,
// sec. 4.2.2), on lesson 08's tensor parallelism, and beside context parallelism.
//
// Tensor parallelism (lesson 08) splits every matrix over the TP ranks but leaves the LayerNorm
// regions (the LayerNorms, the residual stream) and their activations replicated: each TP rank
// holds the whole (B, T, h) there. Sequence parallelism splits those regions along the sequence
// over the same TP ranks, and
// swaps lesson 08's conjugate operators for another pair (the paper's g and g-bar, Fig. 5), with
// the same bytes on the wire, but for one more all-gather a column-parallel layer in backward
// (gather_linear gathers its input again):
//   g     (entering a TP region):  forward all-gather along the sequence,  backward reduce-scatter
//   g-bar (leaving it):            forward reduce-scatter,                 backward all-gather
// so that one allreduce becomes a reduce-scatter plus an all-gather. The TP modules are lesson
// 08's reference ones (solutions/08_tensor_parallel: this lesson does not depend on your lesson
// 08); the model around them is given (sequence_parallel_given.h); the two operators above are
// yours.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "context_parallel.h"
#include "dtc/compat.h"

namespace dtc::l10 {

// ---------------------------------------------------------------------------------------------
// What you implement, part 5: sequence parallelism's two operators
// ---------------------------------------------------------------------------------------------

/// @brief Sequence parallelism's g-bar: each TP rank holds a partial sum of the whole
///   (B, T, h) (a row-parallel layer's output); forward reduce-scatters it along the sequence,
///   rank t keeping rows [t T/tp, (t+1) T/tp) of the sum; backward all-gathers the gradient.
///
/// What must hold (L10SeqPar.ReduceScatter*): the sum over the TP ranks of their inputs' rows of
/// this rank, exactly for integers; the backward, every rank's gradient rows in rank order; one
/// alltoall forward (LibTorch 1.13's gloo has no reduce_scatter), one allgather backward.
/// README section 9 hints.
/// @param x (B, T, ...) contiguous or not; tp divides T
/// @return (B, T/tp, ...)
torch::Tensor reduce_scatter_sequence(const torch::Tensor& x, Comm& tp);

/// @brief Sequence parallelism's g fused with the column-parallel Linear behind it:
///   F::linear(all-gather of x along the sequence, weight, bias), whose backward all-gathers x
///   AGAIN instead of keeping the gathered copy, so that only this rank's (B, T/tp, h) shard is
///   saved (Korthikanti et al. sec. 4.2.2: what makes every activation of the layer 1/tp).
///
/// What must hold (L10SeqPar.GatherLinear*): the values and gradients of
///   F::linear(gathered x, weight, bias), the input's gradient reduce-scattered back to this
///   rank's rows (summed over the TP ranks: each rank's weight holds only its output features);
///   nothing of size (B, T, h) kept between forward and backward.
/// @param x (B, T/tp, in), this rank's rows of the sequence
/// @param weight (out/tp, in) and @p bias (out/tp) or undefined: a ColumnParallelLinear's
/// @return (B, T, out/tp): every row, this rank's output features
torch::Tensor gather_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const torch::Tensor& bias, Comm& tp);

}  // namespace dtc::l10
