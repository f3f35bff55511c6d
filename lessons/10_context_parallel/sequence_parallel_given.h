// Lesson 10, part 5 (given): the tp x cp GPT. Lesson 08's TP GPT with its blocks' attention and
// MLP swapped for the modules below, which run lesson 08's column- and row-parallel layers on this
// CP rank's tokens, this lesson's context-parallel attention over the rank's heads, and, with
// sequence parallelism, your two operators (sequence_parallel.h) at the edges of each TP region.
// The block loop is dtc::Block's own (common/src/model.cpp): what changes is only what is plugged
// in.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "context_parallel.h"
#include "dtc/compat.h"
#include "dtc/data.h"
#include "dtc/model.h"
#include "sequence_parallel.h"
#include "tensor_parallel.h"  // lesson 08's modules (dtc::l08)

namespace dtc::l10 {

/// @brief Checks that sequence parallelism over @p tp ranks can split the seq / cp tokens of a
///   CP rank. @throws UsageError("--seq") naming the multiple of cp x tp to use.
void validate_sequence_parallel(int64_t seq, int cp, int tp);

/// What the swapped-in parts of a tp x cp block share: the groups and the attention.
struct TpCpParts {
  Comm* tp = nullptr;  ///< the TP group (not owned)
  Comm* cp = nullptr;  ///< the CP group (not owned)
  Attention kind = Attention::kRing;
  bool zigzag = false;             ///< the CP split of the sequence
  bool sequence_parallel = false;  ///< Megatron's SP on the TP ranks

  /// Into a TP region: lesson 08's f, or with SP g fused with the column-parallel Linear.
  torch::Tensor enter(const torch::Tensor& x, const l08::ColumnParallelLinear& layer) const;
  /// Out of it: lesson 08's g (allreduce), or with SP g-bar (reduce-scatter), then the bias once.
  torch::Tensor leave(const torch::Tensor& x, const l08::RowParallelLinear& layer) const;
};

/// Lesson 08's TP attention (the same c_attn and c_proj modules, so the same parameters and
/// names), its core the context-parallel attention over this rank's a/tp heads.
class TpCpAttentionImpl : public torch::nn::Module {
 public:
  TpCpAttentionImpl(const l08::TpAttentionImpl& tp_attention, const TpCpParts& parts);
  /// x (B, Tc or Tc/tp with SP, h) -> the same shape.
  torch::Tensor forward(const torch::Tensor& x);

  l08::ColumnParallelLinear c_attn{nullptr};
  l08::RowParallelLinear c_proj{nullptr};
  int64_t local_heads;
  TpCpParts parts;
};
TORCH_MODULE(TpCpAttention);

/// Lesson 08's TP MLP (the same modules), with SP's operators at its edges when on.
class TpCpMlpImpl : public torch::nn::Module {
 public:
  TpCpMlpImpl(const l08::TpMlpImpl& tp_mlp, const TpCpParts& parts);
  torch::Tensor forward(const torch::Tensor& x);

  l08::ColumnParallelLinear c_fc{nullptr};
  l08::RowParallelLinear c_proj{nullptr};
  TpCpParts parts;
};
TORCH_MODULE(TpCpMlp);

/// The course's GPT with its weights split over a TP group (lesson 08's TpGpt: heads, MLP and
/// vocabulary), each sequence split over a CP group (this lesson's attention, over the TP rank's
/// heads), and, with @p sequence_parallel, the LayerNorm and residual regions split along the
/// sequence over the TP ranks too.
class TpCpGptImpl : public torch::nn::Module {
 public:
  /// @brief Rank tp.getRank()'s slices of @p full (l08::TpGpt), on this CP rank's tokens, its
  ///   blocks' attention and MLP swapped for TpCpAttention and TpCpMlp.
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
  ///   them over the TP group (Megatron's allreduce of the sequence-parallel parameters'
  ///   gradients). A no-op without. Call after backward.
  void reduce_replicated_gradients();
  /// The parameters that are replicated on the TP ranks (not split): LayerNorms, wpe, the
  /// row-parallel layers' biases.
  std::vector<torch::Tensor> replicated_parameters() const;

  l08::TpGpt model;         ///< the TP-split weights
  TpCpParts parts;          ///< the groups, the attention, SP
  torch::Tensor positions;  ///< this CP rank's tokens' global positions (seq / cp)
};
TORCH_MODULE(TpCpGpt);

}  // namespace dtc::l10
