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
// 08); the model around them is given; the two operators above are yours.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "context_parallel.h"
#include "dtc/compat.h"
#include "dtc/data.h"
#include "dtc/model.h"
#include "tensor_parallel.h"  // lesson 08's modules (dtc::l08)

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

// ---------------------------------------------------------------------------------------------
// The tp x cp GPT (given)
// ---------------------------------------------------------------------------------------------

/// @brief Checks that sequence parallelism over @p tp ranks can split the seq / cp tokens of a
///   CP rank. @throws UsageError("--seq") naming the multiple of cp x tp to use.
void validate_sequence_parallel(int64_t seq, int cp, int tp);

/// The course's GPT with its weights split over a TP group (lesson 08's TpGpt: heads, MLP and
/// vocabulary), each sequence split over a CP group (this lesson's attention, over the TP rank's
/// heads), and, with @p sequence_parallel, the LayerNorm and residual regions split along the
/// sequence over the TP ranks too.
class TpCpGptImpl : public torch::nn::Module {
 public:
  /// @brief Rank tp.getRank()'s slices of @p full (l08::TpGpt), on this CP rank's tokens.
  /// @throws UsageError (l08::validate_tp, validate_cp with heads/tp heads a rank) when the
  ///   degrees do not split the model, and (--seq) when tp does not divide seq/cp with
  ///   sequence parallelism
  TpCpGptImpl(const Gpt& full, Comm& tp, Comm& cp, Attention kind, bool zigzag,
              bool sequence_parallel);
  /// @brief This rank's share of the batch's mean cross-entropy (the CP rank's tokens' mean
  ///   over the vocabulary-parallel loss, divided by cp): summed over the CP group, the unsplit
  ///   model's loss, the same on every TP rank. @p batch holds the CP rank's tokens.
  torch::Tensor loss(const Batch& batch);
  /// @brief With sequence parallelism, each TP rank's gradient of a replicated parameter (the
  ///   LayerNorms, the position embedding, the row-parallel biases) covers its own rows only: sums
  ///   them over the TP
  ///   group (Megatron's allreduce of the sequence-parallel parameters' gradients). A no-op
  ///   without. Call after backward.
  void reduce_replicated_gradients();
  /// The parameters that are replicated on the TP ranks (not split): LayerNorms, wpe, the
  /// row-parallel layers' biases.
  std::vector<torch::Tensor> replicated_parameters() const;

  l08::TpGpt model;         ///< the TP-split weights
  Comm* tp;                 ///< the TP group (not owned)
  Comm* cp;                 ///< the CP group (not owned)
  Attention kind;           ///< the context-parallel attention (over the local heads)
  bool zigzag = false;      ///< the CP split of the sequence
  bool sequence_parallel;   ///< Megatron's SP on the TP ranks
  torch::Tensor positions;  ///< this CP rank's tokens' global positions (seq / cp)

 private:
  torch::Tensor enter(const torch::Tensor& x, const l08::ColumnParallelLinear& layer);
  torch::Tensor leave(const torch::Tensor& x, const l08::RowParallelLinear& layer);
};
TORCH_MODULE(TpCpGpt);

}  // namespace dtc::l10
