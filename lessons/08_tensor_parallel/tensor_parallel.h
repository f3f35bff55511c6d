// Lesson 08 contract: tensor parallelism, Megatron-LM style (Shoeybi et al. 2019,
// arXiv:1909.08053).
//
// Every matrix of the course's GPT is split across the TP ranks of one group: the MLP's first
// Linear and the attention's QKV by output columns (ColumnParallelLinear, heads split), the two
// output projections by input rows (RowParallelLinear), the token embedding and the output head
// by vocabulary rows (VocabParallelEmbedding, vocab_parallel_cross_entropy). Two conjugate
// communication operators glue them together, as custom autograd functions:
//   f = copy_to_tp:     forward identity,   backward allreduce (sum over the TP group)
//   g = reduce_from_tp: forward allreduce,  backward identity
// Each TP module is built from the full model's module (the same weights as lesson 02's
// baseline) and keeps only its rank's slice. This header is the whole specification of what
// you implement in tensor_parallel.cpp; README.md beside it teaches it. Build and test:
//
//   make test-lesson08          # your exercise, test by test
//   make run-lesson08           # the program on 2 ranks: build/bin/lesson08 --help
//
// Every function that takes a communicator is collective: every rank of @p tp calls it, in the
// same order, with tensors of the same shapes. A module keeps a raw pointer to its communicator:
// the communicator must outlive the module.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "dtc/compat.h"
#include "dtc/data.h"
#include "dtc/dist.h"
#include "dtc/model.h"

namespace dtc::l08 {

// ---------------------------------------------------------------------------------------------
// Given: checks, slices and an in-place allreduce
// ---------------------------------------------------------------------------------------------

/// @brief Checks that @p tp ranks can split @p model: tp divides the hidden size, the heads
///   and the MLP width (4h). The vocabulary need not divide: it is padded (padded_vocab()).
/// @throws UsageError naming --tp (and the size that it does not divide) otherwise, or when tp
///   is below 1; the hint lists the tp values that would fit.
void validate_tp(const GptConfig& model, int tp);

/// @brief Slice number @p rank of @p parts equal slices of @p full along @p dim, as a new
///   contiguous tensor (a copy, not a view).
/// @throws std::invalid_argument when parts does not divide full.size(dim)
torch::Tensor shard(const torch::Tensor& full, int64_t dim, int rank, int parts);

/// @brief @p vocab rounded up to a multiple of @p tp: the rows of the embedding and of the
///   output head that tp ranks split equally (Megatron pads further, to a multiple of
///   128 x tp, `make-vocab-size-divisible-by`, for the GEMMs' sake). GPT-2's 50,257 tokens
///   become 50,258 on 2 ranks and 50,260 on 4 or 8.
int64_t padded_vocab(int64_t vocab, int tp);

/// @brief Slice @p rank of @p parts of @p full's rows after padding them with zero rows to
///   padded_vocab(rows, parts): a new contiguous (padded / parts, ...) tensor.
torch::Tensor shard_padded_rows(const torch::Tensor& full, int rank, int parts);

/// @brief Allreduces @p t in place over @p comm with @p op and waits.
void allreduce_(torch::Tensor& t, Comm& comm, c10d::ReduceOp op = c10d::ReduceOp::SUM);

// ---------------------------------------------------------------------------------------------
// What you implement, part 1: the conjugate operators f and g (custom autograd functions)
// ---------------------------------------------------------------------------------------------

/// @brief Megatron's f: forward is the identity, backward allreduces (sums) the gradient over
///   @p tp.
///
/// Put it in front of every module whose input is replicated on the TP ranks and whose
/// parameters are split: each rank computes only its part of dL/dx, and the sum of the parts is
/// the full gradient. Implement it as a torch::autograd::Function: the communicator reaches
/// backward through ctx->saved_data (a pointer stored as an int64 IValue).
/// @param x any tensor, the same on every TP rank
/// @return a tensor equal to x, whose gradient is summed over @p tp in backward
torch::Tensor copy_to_tp(const torch::Tensor& x, Comm& tp);

/// @brief Megatron's g: forward allreduces (sums) @p x over @p tp, backward is the identity.
///
/// Put it after every module whose output is a partial sum on each TP rank (a row-parallel
/// Linear, a vocabulary-parallel lookup). Forward must not modify @p x: sum a copy.
/// @return the sum of x over the TP ranks, the same on every rank
torch::Tensor reduce_from_tp(const torch::Tensor& x, Comm& tp);

// ---------------------------------------------------------------------------------------------
// What you implement, part 2: the parallel Linear layers
// ---------------------------------------------------------------------------------------------

/// A Linear y = x W^T + b whose output features are split across the TP ranks: rank r keeps
/// rows [r * out/tp, (r+1) * out/tp) of W (out, in) and of b. Input replicated, output split.
class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  /// @brief Rank tp.getRank()'s slice of @p full (given): weight (out/tp, in), bias (out/tp).
  /// @throws std::invalid_argument when tp does not divide out
  ColumnParallelLinearImpl(const torch::nn::Linear& full, Comm& tp);
  /// @brief Takes already-sliced parameters (given): @p weight (out/tp, in), @p bias (out/tp)
  ///   or an undefined tensor for no bias.
  ColumnParallelLinearImpl(const torch::Tensor& weight, const torch::Tensor& bias, Comm& tp);
  /// @brief x (..., in), the same on every TP rank -> this rank's output features (..., out/tp).
  ///
  /// f first (copy_to_tp: the input's gradient is summed over the ranks), then the local
  /// Linear with this rank's weight and bias.
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight;  ///< (out/tp, in)
  torch::Tensor bias;    ///< (out/tp), or undefined
  Comm* tp;              ///< the TP group (not owned)
  /// When true, forward() runs linear_async_dgrad() instead (given): the same values and
  /// gradients, with backward's allreduce of the input gradient overlapped with the
  /// weight-gradient matmul.
  bool overlap_dgrad = false;
};
TORCH_MODULE(ColumnParallelLinear);

/// @brief f and the column-parallel Linear in one autograd function, whose backward overlaps
///   communication with compute as Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication
///   does (its allreduce_dgrad): the input gradient dX = dY W is computed first and its
///   allreduce over @p tp started without waiting; the weight gradient dW = dY^T X (and the
///   bias's), which does not need it, is computed while the allreduce runs; then wait. Values
///   and gradients are those of F::linear(copy_to_tp(x), weight, bias). Given.
torch::Tensor linear_async_dgrad(const torch::Tensor& x, const torch::Tensor& weight,
                                 const torch::Tensor& bias, Comm& tp);

/// A Linear y = x W^T + b whose input features are split across the TP ranks: rank r keeps
/// columns [r * in/tp, (r+1) * in/tp) of W (out, in) and the whole bias b (out), replicated.
/// Input split, output replicated.
class RowParallelLinearImpl : public torch::nn::Module {
 public:
  /// @brief Rank tp.getRank()'s slice of @p full (given): weight (out, in/tp), bias (out).
  /// @throws std::invalid_argument when tp does not divide in
  RowParallelLinearImpl(const torch::nn::Linear& full, Comm& tp);
  /// @brief This rank's input features (..., in/tp) -> the full output (..., out), the same on
  ///   every TP rank.
  ///
  /// The local product x W_r^T is a partial sum: g (reduce_from_tp) adds the ranks' parts; then
  /// add the bias once, after the sum (adding it on every rank before the sum would count it tp
  /// times).
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight;  ///< (out, in/tp)
  torch::Tensor bias;    ///< (out), the same on every TP rank
  Comm* tp;              ///< the TP group (not owned)
};
TORCH_MODULE(RowParallelLinear);

// ---------------------------------------------------------------------------------------------
// What you implement, part 3: the tensor-parallel MLP and attention
// ---------------------------------------------------------------------------------------------

/// The MLP of one block, split Megatron's way: c_fc column-parallel (h -> 4h/tp), GELU on the
/// local slice (elementwise: no communication), c_proj row-parallel (4h/tp -> h). One f in
/// front, one g behind: one allreduce forward, one backward.
class TpMlpImpl : public torch::nn::Module {
 public:
  /// @brief Rank tp.getRank()'s slices of @p full's weights (given).
  TpMlpImpl(const Mlp& full, Comm& tp);
  /// @brief x (B, T, h), replicated -> (B, T, h), replicated: c_proj(gelu(c_fc(x))).
  torch::Tensor forward(const torch::Tensor& x);

  ColumnParallelLinear c_fc{nullptr};
  RowParallelLinear c_proj{nullptr};
};
TORCH_MODULE(TpMlp);

/// Causal self-attention with the heads split: rank r owns heads [r * a/tp, (r+1) * a/tp).
/// c_attn is column-parallel, but its output is three blocks [q | k | v] of h features each,
/// so rank r's weight is the r-th slice of EACH block, stacked: rows
///   [r*h/tp, (r+1)*h/tp)  +  h + the same  +  2h + the same      of c_attn's (3h, h) weight
/// (and of its bias); c_proj is row-parallel over the concatenated head outputs.
class TpAttentionImpl : public torch::nn::Module {
 public:
  /// @brief Rank tp.getRank()'s heads of @p full.
  ///
  /// Build c_attn from the stacked q, k and v slices described above (weight (3h/tp, h), bias
  /// (3h/tp)), and c_proj as RowParallelLinear(full->c_proj, tp).
  /// @param full the unsplit attention, with the baseline's weights
  /// @param heads the full model's heads (a); this rank owns a/tp of them
  /// @param tp the TP group; this rank's heads are those of slice tp.getRank()
  TpAttentionImpl(const CausalSelfAttention& full, int64_t heads, Comm& tp);
  /// @brief x (B, T, h), replicated -> (B, T, h), replicated.
  ///
  /// The same computation as dtc::CausalSelfAttentionImpl::forward (common/src/model.cpp), on
  /// a/tp heads: qkv = c_attn(x) (B, T, 3h/tp), split into q, k, v (B, T, h/tp) each, view as
  /// (B, a/tp, T, d) with d = h/a, causal softmax(q k^T / sqrt(d)) v, back to (B, T, h/tp),
  /// then c_proj.
  torch::Tensor forward(const torch::Tensor& x);

  ColumnParallelLinear c_attn{nullptr};
  RowParallelLinear c_proj{nullptr};
  int64_t local_heads;  ///< a / tp
};
TORCH_MODULE(TpAttention);

// ---------------------------------------------------------------------------------------------
// What you implement, part 4: the vocabulary-parallel embedding and cross-entropy
// ---------------------------------------------------------------------------------------------

/// The token embedding split by vocabulary rows: with Vp = padded_vocab(V, tp) rank r keeps
/// rows [r Vp/tp, (r+1) Vp/tp) of the (V, h) table padded with zero rows to Vp; the real ones
/// are [vocab_begin, vocab_end), vocab_end = min((r+1) Vp/tp, V). The padding rows are never
/// looked up (their gradient stays 0).
class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  /// @brief Rank tp.getRank()'s rows of @p full's (V, h) weight (given).
  VocabParallelEmbeddingImpl(const torch::nn::Embedding& full, Comm& tp);
  /// @brief tokens (B, T) int64 in [0, V) -> embeddings (B, T, h), replicated.
  ///
  /// Each rank looks up only the tokens in its own range (at index token - vocab_begin; clamp
  /// the others to a valid index and zero their rows), so every row is nonzero on exactly one
  /// rank; g (reduce_from_tp) adds them up.
  torch::Tensor forward(const torch::Tensor& tokens);

  torch::Tensor weight;     ///< (Vp/tp, h), padding rows included
  int64_t vocab_begin = 0;  ///< first token id of this rank's rows
  int64_t vocab_end = 0;    ///< one past the last real one (padding rows excluded)
  Comm* tp;                 ///< the TP group (not owned)
};
TORCH_MODULE(VocabParallelEmbedding);

/// @brief The mean cross-entropy over N positions, from logits split by vocabulary, without
///   ever gathering the (N, V) logits (Megatron's vocab-parallel cross-entropy).
///
/// What must hold (L08Modules.VocabParallelCrossEntropyMatchesTheFullOne): on every TP rank, the
/// value of F::cross_entropy on the full (N, V) logits and, through backward, this rank's slice
/// of its gradient, within one fp32 op; finite for logits in the thousands, where fp32's exp
/// overflows; and only vectors of N numbers cross the TP group, never the N x V logits.
/// README section 5 gives the identity to start from, and hints.
/// With a padded vocabulary (L08Vocabulary.PaddedVocabularyMatchesTheFullOne), columns of id
/// vocab_size and above are padding: they take no part in the softmax (as if their logits were
/// -inf), so the loss and the real columns' gradients are those of the unpadded V columns, and
/// the padding columns' gradient is 0.
/// @param logits_local (N, Vp/tp): this rank's vocabulary columns
///   [vocab_begin, vocab_begin + Vp/tp)
/// @param targets (N) int64 in [0, V), the same on every TP rank
/// @param vocab_begin the first vocabulary id of this rank's columns
/// @param vocab_size V, the real vocabulary; 0: every column is real
/// @return a 0-dim float tensor, the same on every TP rank, that backward() can start from; its
///   gradient with respect to logits_local is the matching slice of the full gradient
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits_local,
                                           const torch::Tensor& targets, int64_t vocab_begin,
                                           Comm& tp, int64_t vocab_size = 0);

// ---------------------------------------------------------------------------------------------
// The tensor-parallel GPT (given, except its output head)
// ---------------------------------------------------------------------------------------------

/// The course's GPT split over a TP group: token embedding and output head by vocabulary,
/// position embedding and LayerNorms replicated, and each block the course's dtc::Block with its
/// attention and MLP swapped for TpAttention and TpMlp (Block::swap_attention, swap_mlp: the
/// parameter names stay h.{i}.attn.*, h.{i}.mlp.*). 4 allreduces per block and step: f and g of
/// attention and of the MLP, each once forward and once backward.
class TpGptImpl : public torch::nn::Module {
 public:
  /// @brief Rank tp.getRank()'s slice of @p full (given): build the full model, init_weights,
  ///   then shard it, so that the TP model starts from the baseline's exact weights.
  /// @throws UsageError (validate_tp) when tp does not divide the model
  TpGptImpl(const Gpt& full, Comm& tp);
  /// @brief Sets ColumnParallelLinearImpl::overlap_dgrad on every column-parallel layer (the
  ///   attention's c_attn, the MLP's c_fc). Given.
  void set_overlap_dgrad(bool on);
  /// @brief tokens (B, T) -> this rank's logits (B, T, Vp/tp), vocabulary columns
  ///   [wte->vocab_begin, wte->vocab_begin + Vp/tp) (columns past V are padding).
  ///
  /// Given: the embeddings and the blocks. Yours: the output head, which is column-parallel
  /// over the vocabulary with the (tied) wte->weight or the untied lm_head (V/tp, h): put f in
  /// front of it (its input is replicated, its weight split).
  torch::Tensor forward(const torch::Tensor& tokens);
  /// @brief The mean next-token cross-entropy on @p batch (given):
  ///   vocab_parallel_cross_entropy(forward(inputs) as (B*T, Vp/tp), targets (B*T), V).
  torch::Tensor loss(const Batch& batch);
  const GptConfig& config() const { return config_; }

  VocabParallelEmbedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::Tensor lm_head;  ///< (V/tp, h) when untied; undefined when tied
  Comm* tp;               ///< the TP group (not owned)

 private:
  GptConfig config_;
};
TORCH_MODULE(TpGpt);

}  // namespace dtc::l08
