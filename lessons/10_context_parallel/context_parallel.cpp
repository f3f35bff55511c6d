// Lesson 10: context parallelism. Implements lessons/10_context_parallel/context_parallel.h.
//
// Fill in every TODO(L10) below, top to bottom; `make test-lesson10` checks the merge in closed
// form, then each attention's values and gradients against the unsplit attention on the same
// q, k, v (2, 3 and 4 ranks), then whole training runs against the single-process baseline.
// The all-to-all, Ulysses' and all-gather's attention around your parts, context_attention and
// the context-parallel GPT are given, in context_attention_given.cpp.
#include "context_parallel.h"

#include <fmt/format.h>

#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtc/dist.h"
#include "dtc/errors.h"
#include "dtc/todo.h"
#include "dtc/trace.h"

namespace dtc::l10 {

namespace F = torch::nn::functional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

}  // namespace

// ---------------------------------------------------------------------------------------------
// Part 1: the online-softmax merge
// ---------------------------------------------------------------------------------------------

void merge_block(torch::Tensor& out, torch::Tensor& lse, const BlockOut& block) {
  // TODO(L10)
  DTC_TODO("L10",
           "(out, lse) become the attention over the keys seen so far and the block's, "
           "in place, finite for scores in the thousands, rows with lse -inf on either side "
           "handled "
           "(L10Merge.*; README section 2)");
}

// ---------------------------------------------------------------------------------------------
// Part 2: ring attention
// ---------------------------------------------------------------------------------------------

RingBlock ring_block(int rank, int src, int cp, int64_t local_len, bool zigzag, bool causal) {
  RingBlock b;
  // TODO(L10)
  DTC_TODO("L10",
           "only the (query, key) pairs the causal mask lets through, nothing wholly in "
           "the future, the same work on every rank with zig-zag (L10Ring.BlockPlan*; README "
           "section 3)");
  return b;
}

namespace {

// Rotations use tags 0-1 (K, V) and 2-3 (their gradients, in backward).
constexpr int kKvTag = 0;
constexpr int kGradTag = 2;

struct RingAttentionFn : public torch::autograd::Function<RingAttentionFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, int64_t comm, bool zigzag, bool causal) {
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["zigzag"] = zigzag;
    ctx->saved_data["causal"] = causal;
    save_tracer(ctx);  // backward runs on autograd's device thread on CUDA: its spans need it
    Comm& cp = comm_from(comm);
    const int rank = cp.getRank(), n = cp.getSize();
    const int64_t tl = q.size(2), seq = tl * n;
    auto sizes = q.sizes().vec();
    torch::Tensor out = torch::zeros(sizes, q.options().dtype(torch::kFloat));
    sizes.pop_back();
    torch::Tensor lse = torch::full(sizes, -kInf, q.options().dtype(torch::kFloat));
    const torch::Tensor q_pos = local_positions(seq, rank, n, zigzag);
    // TODO(L10)
    DTC_TODO("L10",
             "cp steps, each merging ring_block's part of the visiting K/V block, the "
             "next block's rotation in flight while this one is computed (L10Ring.*; README "
             "section 3 "
             "hints)");
    ctx->save_for_backward({q, k, v, out, lse});
    return out.to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TraceScope trace(saved_tracer(ctx));  // the "attn bwd" spans, on whichever thread runs this
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    [[maybe_unused]] const torch::Tensor& out = saved[3];  // the merged forward, float32
    [[maybe_unused]] const torch::Tensor& lse = saved[4];  // (B, H, Tl) float32
    const bool zigzag = ctx->saved_data["zigzag"].toBool();
    [[maybe_unused]] const bool causal = ctx->saved_data["causal"].toBool();
    Comm& cp = comm_of(ctx);
    const int rank = cp.getRank(), n = cp.getSize();
    const int64_t tl = q.size(2), seq = tl * n;
    const torch::Tensor dout = grad_outputs[0].to(torch::kFloat);
    const torch::Tensor q_pos = local_positions(seq, rank, n, zigzag);
    torch::Tensor dq = torch::zeros(q.sizes(), q.options().dtype(torch::kFloat));
    torch::Tensor dk, dv;  // this rank's own K/V gradients, (B, H, Tl, D) float32
    // TODO(L10)
    DTC_TODO("L10",
             "the same cp steps; every rank adds its block_attention_backward "
             "contribution to the visiting block's dK/dV, which travel one hop a step, cp hops "
             "in all, "
             "the last bringing them home (L10Ring.*; README section 3 hints)");
    return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type()),
            torch::Tensor(),        torch::Tensor(),        torch::Tensor()};
  }
};

}  // namespace

torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             Comm& cp, bool zigzag, bool causal) {
  return RingAttentionFn::apply(q, k, v, comm_handle(cp), zigzag, causal);
}

// ---------------------------------------------------------------------------------------------
// Part 3: Ulysses (all-to-all) attention
// ---------------------------------------------------------------------------------------------

namespace {

torch::Tensor seq_to_heads_impl(const torch::Tensor& x, Comm& cp) {
  const int n = cp.getSize();
  const int64_t H = x.size(1);
  if (H % n != 0) {
    throw std::invalid_argument(
        fmt::format("seq_to_heads: {} heads do not split over cp {}", H, n));
  }
  // TODO(L10)
  DTC_TODO("L10",
           "(B, H, Tl, D) -> (B, H/cp, cp Tl, D): this rank's heads, every rank's tokens "
           "in rank order, with one alltoall (L10Ulysses.*; README section 4 hints)");
}

torch::Tensor heads_to_seq_impl(const torch::Tensor& x, Comm& cp) {
  // TODO(L10)
  DTC_TODO("L10",
           "(B, H/cp, cp Tl, D) -> (B, H, Tl, D), undoing seq_to_heads exactly, with one "
           "alltoall (L10Ulysses.*; README section 4 hints)");
}

struct SeqToHeadsFn : public torch::autograd::Function<SeqToHeadsFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return seq_to_heads_impl(x, comm_from(comm));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {heads_to_seq_impl(g[0], comm_of(ctx)), torch::Tensor()};
  }
};

struct HeadsToSeqFn : public torch::autograd::Function<HeadsToSeqFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return heads_to_seq_impl(x, comm_from(comm));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {seq_to_heads_impl(g[0], comm_of(ctx)), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor seq_to_heads(const torch::Tensor& x, Comm& cp) {
  return SeqToHeadsFn::apply(x, comm_handle(cp));
}

torch::Tensor heads_to_seq(const torch::Tensor& x, Comm& cp) {
  return HeadsToSeqFn::apply(x, comm_handle(cp));
}

// ---------------------------------------------------------------------------------------------
// Part 4: all-gather KV attention
// ---------------------------------------------------------------------------------------------

namespace {

struct GatherSequenceFn : public torch::autograd::Function<GatherSequenceFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    [[maybe_unused]] Comm& cp = comm_from(comm);
    // TODO(L10)
    DTC_TODO("L10",
             "(B, H, Tl, D) -> (B, H, cp Tl, D), rank j's rows at [j Tl, (j+1) Tl), with "
             "one allgather (L10AllGather.*; README section 5 hints)");
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    [[maybe_unused]] Comm& cp = comm_of(ctx);
    // TODO(L10)
    DTC_TODO("L10",
             "the gradient of this rank's rows summed over every rank's copy, with one "
             "alltoall (L10AllGather.*; README section 5 hints)");
  }
};

}  // namespace

torch::Tensor gather_sequence(const torch::Tensor& x, Comm& cp) {
  return GatherSequenceFn::apply(x, comm_handle(cp));
}

}  // namespace dtc::l10
// generated from solutions/10_context_parallel/context_parallel.cpp; checksum 49e031b21451f347
