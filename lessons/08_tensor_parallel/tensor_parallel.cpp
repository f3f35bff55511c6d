// Lesson 08: tensor parallelism. Implements lessons/08_tensor_parallel/tensor_parallel.h.
//
// Fill in every TODO(L08) below, top to bottom; `make test-lesson08` checks each parallel
// module's outputs and gradients against the unsplit module on the same weights (2 and 4 ranks),
// then whole training runs against the single-process baseline and PyTorch.
// The checks, slices, constructors and the GPT around your modules are given, in
// tensor_parallel_given.cpp.
#include "tensor_parallel.h"

#include <cmath>
#include <limits>
#include <vector>

#include "dtc/todo.h"

namespace dtc::l08 {

namespace F = torch::nn::functional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---------------------------------------------------------------------------------------------
// Part 1: the conjugate operators f and g
// ---------------------------------------------------------------------------------------------

/// f: identity forward, allreduce backward.
struct CopyToTp : public torch::autograd::Function<CopyToTp> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    // TODO(L08)
    DTC_TODO("L08",
             "f's forward is the identity: the output equals x, with no communication "
             "(L08Ops.*; README section 3)");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    // TODO(L08)
    DTC_TODO("L08",
             "dL/dx is the incoming gradient summed over the TP group, autograd's own "
             "buffer left as it was; one entry per forward argument (L08Ops.*; README section 3 "
             "hints)");
  }
};

/// g: allreduce forward, identity backward.
struct ReduceFromTp : public torch::autograd::Function<ReduceFromTp> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    // TODO(L08)
    DTC_TODO("L08",
             "every rank gets the sum of x over the TP group, and the caller's x is left "
             "as it was (L08Ops.*; README section 3 hints)");
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grad_outputs) {
    // TODO(L08)
    DTC_TODO("L08",
             "g's backward is the identity: dL/dx = dL/dy; one entry per forward "
             "argument (L08Ops.*; README section 3 hints)");
  }
};

torch::Tensor copy_to_tp(const torch::Tensor& x, Comm& tp) {
  return CopyToTp::apply(x, comm_handle(tp));
}

torch::Tensor reduce_from_tp(const torch::Tensor& x, Comm& tp) {
  return ReduceFromTp::apply(x, comm_handle(tp));
}

// ---------------------------------------------------------------------------------------------
// Part 2: the parallel Linear layers
// ---------------------------------------------------------------------------------------------

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  if (overlap_dgrad) return linear_async_dgrad(x, weight, bias, *tp);  // given
  // TODO(L08)
  DTC_TODO("L08",
           "(..., in), replicated -> this rank's out/tp features of x W^T + b, and x's "
           "gradient summed over the TP group in backward "
           "(L08Modules.ColumnAndRowParallelLinear; "
           "README section 2 hints)");
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x) {
  // TODO(L08)
  DTC_TODO("L08",
           "this rank's in/tp input features -> the unsplit Linear's output (..., out) on "
           "every rank, its bias counted once (L08Modules.ColumnAndRowParallelLinear; README "
           "section 2 "
           "hints)");
}

// ---------------------------------------------------------------------------------------------
// Part 3: the tensor-parallel MLP and attention
// ---------------------------------------------------------------------------------------------

torch::Tensor TpMlpImpl::forward(const torch::Tensor& x) {
  // TODO(L08)
  DTC_TODO("L08",
           "the unsplit MLP's output (B, T, h) on every rank, with no communication "
           "between the two Linears (L08Modules.MlpMatchesTheUnsplitMlp; README section 2 hints)");
}

TpAttentionImpl::TpAttentionImpl(const CausalSelfAttention& full, int64_t heads, Comm& tp) {
  local_heads = heads / tp.getSize();
  torch::Tensor w, b;  // this rank's c_attn weight (3h/tp, h) and bias (3h/tp)
  // TODO(L08)
  DTC_TODO("L08",
           "w (3h/tp, h) and b (3h/tp) hold this rank's heads of q, then of k, then of v, "
           "so that c_attn(x) is [q_r | k_r | v_r] "
           "(L08Modules.AttentionMatchesTheUnsplitAttention; "
           "README section 4 hints)");
  c_attn = register_module("c_attn", ColumnParallelLinear(w, b, tp));
  c_proj = register_module("c_proj", RowParallelLinear(full->c_proj, tp));
}

torch::Tensor TpAttentionImpl::forward(const torch::Tensor& x) {
  // TODO(L08)
  DTC_TODO("L08",
           "the unsplit attention's output (B, T, h) on every rank, computed from this "
           "rank's local_heads heads only (L08Modules.AttentionMatchesTheUnsplitAttention; "
           "README "
           "section 4 hints)");
}

// ---------------------------------------------------------------------------------------------
// Part 4: the vocabulary-parallel embedding and cross-entropy
// ---------------------------------------------------------------------------------------------

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& tokens) {
  // TODO(L08)
  DTC_TODO("L08",
           "tokens (B, T) -> the full table's rows (B, T, h) on every rank, each row from "
           "the one rank that owns its token; no rank indexes outside its own rows "
           "(L08Modules.VocabParallelEmbeddingMatchesTheFullTable; README section 5 hints)");
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits_local_in,
                                           const torch::Tensor& targets, int64_t vocab_begin,
                                           Comm& tp, int64_t vocab_size) {
  // TODO(L08)
  DTC_TODO("L08",
           "the mean loss from per-rank parts, a few allreduces of N numbers each, "
           "exact for logits in the thousands, padding columns (id >= vocab_size) out of the "
           "softmax "
           "(L08Modules.VocabParallelCrossEntropyMatchesTheFullOne, L08Vocabulary.*; README "
           "section 5 "
           "hints)");
}

// ---------------------------------------------------------------------------------------------
// The tensor-parallel GPT
// ---------------------------------------------------------------------------------------------

torch::Tensor TpGptImpl::forward(const torch::Tensor& tokens) {
  const int64_t T = tokens.size(1);
  auto pos = torch::arange(T, torch::dtype(torch::kLong).device(tokens.device()));
  auto x = wte(tokens) + wpe(pos);  // (B, T, h), replicated
  // dtc::Block::forward: its spans on a --trace timeline, LayerNorms and residual adds
  // replicated on every TP rank, the swapped attention and MLP split
  x = forward_blocks(*h, x);
  x = ln_f(x);
  // TODO(L08)
  DTC_TODO("L08",
           "this rank's logits (B, T, V/tp) from the tied wte->weight or the untied "
           "lm_head, with the full gradient flowing back into ln_f "
           "(L08Modules.WholeModelLogitsMatch, "
           "L08Training.*; README section 5 hints)");
}

}  // namespace dtc::l08
// generated from solutions/08_tensor_parallel/tensor_parallel.cpp; checksum 183d206dbd0de17c
