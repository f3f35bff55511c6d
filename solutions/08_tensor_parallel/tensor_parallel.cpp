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
    // BEGIN SOLUTION: f's forward is the identity: the output equals x, with no communication
    //   (L08Ops.*; README section 3)
    return x;
    // END SOLUTION
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    // BEGIN SOLUTION: dL/dx is the incoming gradient summed over the TP group, autograd's own
    //   buffer left as it was; one entry per forward argument (L08Ops.*; README section 3 hints)
    torch::Tensor grad = grad_outputs[0].clone();  // never reduce autograd's buffer in place
    allreduce_(grad, comm_of(ctx));
    return {grad, torch::Tensor()};
    // END SOLUTION
  }
};

/// g: allreduce forward, identity backward.
struct ReduceFromTp : public torch::autograd::Function<ReduceFromTp> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    // BEGIN SOLUTION: every rank gets the sum of x over the TP group, and the caller's x is left
    //   as it was (L08Ops.*; README section 3 hints)
    torch::Tensor sum = x.clone();  // x belongs to the caller: never modify it
    allreduce_(sum, comm_of(ctx));
    return sum;
    // END SOLUTION
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grad_outputs) {
    // BEGIN SOLUTION: g's backward is the identity: dL/dx = dL/dy; one entry per forward
    //   argument (L08Ops.*; README section 3 hints)
    return {grad_outputs[0], torch::Tensor()};
    // END SOLUTION
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
  // BEGIN SOLUTION: (..., in), replicated -> this rank's out/tp features of x W^T + b, and x's
  //   gradient summed over the TP group in backward (L08Modules.ColumnAndRowParallelLinear;
  //   README section 2 hints)
  return F::linear(copy_to_tp(x, *tp), weight, bias);
  // END SOLUTION
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x) {
  // BEGIN SOLUTION: this rank's in/tp input features -> the unsplit Linear's output (..., out) on
  //   every rank, its bias counted once (L08Modules.ColumnAndRowParallelLinear; README section 2
  //   hints)
  torch::Tensor y = reduce_from_tp(F::linear(x, weight), *tp);
  return bias.defined() ? y + bias : y;
  // END SOLUTION
}

// ---------------------------------------------------------------------------------------------
// Part 3: the tensor-parallel MLP and attention
// ---------------------------------------------------------------------------------------------

torch::Tensor TpMlpImpl::forward(const torch::Tensor& x) {
  // BEGIN SOLUTION: the unsplit MLP's output (B, T, h) on every rank, with no communication
  //   between the two Linears (L08Modules.MlpMatchesTheUnsplitMlp; README section 2 hints)
  return c_proj(torch::gelu(c_fc(x)));
  // END SOLUTION
}

TpAttentionImpl::TpAttentionImpl(const CausalSelfAttention& full, int64_t heads, Comm& tp) {
  local_heads = heads / tp.getSize();
  torch::Tensor w, b;  // this rank's c_attn weight (3h/tp, h) and bias (3h/tp)
  // BEGIN SOLUTION: w (3h/tp, h) and b (3h/tp) hold this rank's heads of q, then of k, then of v,
  //   so that c_attn(x) is [q_r | k_r | v_r] (L08Modules.AttentionMatchesTheUnsplitAttention;
  //   README section 4 hints)
  const int r = tp.getRank(), n = tp.getSize();
  auto wq_k_v = full->c_attn->weight.chunk(3, 0);  // 3 x (h, h)
  auto bq_k_v = full->c_attn->bias.chunk(3, 0);    // 3 x (h)
  std::vector<torch::Tensor> ws, bs;
  for (int part = 0; part < 3; ++part) {
    ws.push_back(shard(wq_k_v[part], 0, r, n));  // (h/tp, h): this rank's heads of q, k or v
    bs.push_back(shard(bq_k_v[part], 0, r, n));
  }
  w = torch::cat(ws, 0);  // (3h/tp, h) = [q_r; k_r; v_r]
  b = torch::cat(bs, 0);  // (3h/tp)
  // END SOLUTION
  c_attn = register_module("c_attn", ColumnParallelLinear(w, b, tp));
  c_proj = register_module("c_proj", RowParallelLinear(full->c_proj, tp));
}

torch::Tensor TpAttentionImpl::forward(const torch::Tensor& x) {
  // BEGIN SOLUTION: the unsplit attention's output (B, T, h) on every rank, computed from this
  //   rank's local_heads heads only (L08Modules.AttentionMatchesTheUnsplitAttention; README
  //   section 4 hints)
  const int64_t B = x.size(0), T = x.size(1);
  auto qkv = c_attn(x);                  // (B, T, 3C) with C = h/tp, this rank's heads only
  const int64_t C = qkv.size(2) / 3;     // h/tp
  const int64_t D = C / local_heads;     // head size h/a, as in the unsplit model
  auto parts = qkv.split(C, /*dim=*/2);  // q, k, v: (B, T, C) each
  auto q = parts[0].view({B, T, local_heads, D}).transpose(1, 2);  // (B, a/tp, T, D)
  auto k = parts[1].view({B, T, local_heads, D}).transpose(1, 2);
  auto v = parts[2].view({B, T, local_heads, D}).transpose(1, 2);
  auto att = q.matmul(k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(D)));
  auto future = torch::ones({T, T}, torch::dtype(torch::kBool).device(x.device())).triu(1);
  att = att.masked_fill(future, -std::numeric_limits<float>::infinity()).softmax(-1);
  auto y = att.matmul(v).transpose(1, 2).contiguous().view({B, T, C});  // (B, T, h/tp)
  return c_proj(y);  // g inside: (B, T, h), summed over the heads of every rank
  // END SOLUTION
}

// ---------------------------------------------------------------------------------------------
// Part 4: the vocabulary-parallel embedding and cross-entropy
// ---------------------------------------------------------------------------------------------

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& tokens) {
  // BEGIN SOLUTION: tokens (B, T) -> the full table's rows (B, T, h) on every rank, each row from
  //   the one rank that owns its token; no rank indexes outside its own rows
  //   (L08Modules.VocabParallelEmbeddingMatchesTheFullTable; README section 5 hints)
  auto mine = (tokens >= vocab_begin).logical_and(tokens < vocab_end);  // (B, T) bool
  auto local = (tokens - vocab_begin).masked_fill(mine.logical_not(), 0);
  auto rows = F::embedding(local, weight);                         // (B, T, h)
  rows = rows.masked_fill(mine.logical_not().unsqueeze(-1), 0.0);  // not my token: 0
  return reduce_from_tp(rows, *tp);                                // exactly one rank held each row
  // END SOLUTION
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits_local_in,
                                           const torch::Tensor& targets, int64_t vocab_begin,
                                           Comm& tp, int64_t vocab_size) {
  // BEGIN SOLUTION: the mean loss from per-rank parts, a few allreduces of N numbers each,
  //   exact for logits in the thousands, padding columns (id >= vocab_size) out of the softmax
  //   (L08Modules.VocabParallelCrossEntropyMatchesTheFullOne, L08Vocabulary.*; README section 5
  //   hints)
  const int64_t local_vocab = logits_local_in.size(1);
  torch::Tensor logits_local = logits_local_in;
  if (vocab_size > 0 && vocab_begin + local_vocab > vocab_size) {
    // Padding columns: -inf, so exp() gives 0 and no gradient reaches them.
    auto ids = torch::arange(local_vocab, targets.options()) + vocab_begin;  // (Vp/tp)
    logits_local = logits_local_in.masked_fill((ids >= vocab_size).unsqueeze(0),
                                               -std::numeric_limits<float>::infinity());
  }
  // 1. The row max over the whole vocabulary: a constant shift, so no gradient flows through it.
  torch::Tensor m = std::get<0>(logits_local.detach().max(/*dim=*/1));  // (N)
  allreduce_(m, tp, c10d::ReduceOp::MAX);
  torch::Tensor z = logits_local - m.unsqueeze(1);  // (N, V/tp), every entry <= 0
  // 2. sum_v exp(z_v) over the whole vocabulary: local sums, added by g.
  torch::Tensor sum_exp = reduce_from_tp(z.exp().sum(1), tp);  // (N)
  // 3. The target's logit: on the rank whose columns hold it; 0 elsewhere; added by g.
  auto mine = (targets >= vocab_begin).logical_and(targets < vocab_begin + local_vocab);
  auto local = (targets - vocab_begin).masked_fill(mine.logical_not(), 0);
  torch::Tensor zt = z.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(mine.logical_not(), 0);
  zt = reduce_from_tp(zt, tp);  // (N)
  return (sum_exp.log() - zt).mean();
  // END SOLUTION
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
  // BEGIN SOLUTION: this rank's logits (B, T, V/tp) from the tied wte->weight or the untied
  //   lm_head, with the full gradient flowing back into ln_f (L08Modules.WholeModelLogitsMatch,
  //   L08Training.*; README section 5 hints)
  const torch::Tensor& w = config_.tied ? wte->weight : lm_head;
  return torch::matmul(copy_to_tp(x, *tp), w.t());
  // END SOLUTION
}

}  // namespace dtc::l08
