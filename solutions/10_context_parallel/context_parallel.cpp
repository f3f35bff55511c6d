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
  // BEGIN SOLUTION: (out, lse) become the attention over the keys seen so far and the block's,
  //   in place, finite for scores in the thousands, rows with lse -inf on either side handled
  //   (L10Merge.*; README section 2)
  torch::NoGradGuard no_grad;
  const torch::Tensor merged = torch::logaddexp(lse, block.lse);  // -inf only if both are
  const torch::Tensor safe = torch::where(torch::isinf(merged), torch::zeros_like(merged), merged);
  const torch::Tensor w_old = (lse - safe).exp().unsqueeze(-1);  // exp(-inf) = 0: nothing yet
  const torch::Tensor w_new = (block.lse - safe).exp().unsqueeze(-1);
  out.copy_(out * w_old + block.out.to(out.scalar_type()) * w_new);
  lse.copy_(merged);
  // END SOLUTION
}

// ---------------------------------------------------------------------------------------------
// Part 2: ring attention
// ---------------------------------------------------------------------------------------------

RingBlock ring_block(int rank, int src, int cp, int64_t local_len, bool zigzag, bool causal) {
  RingBlock b;
  // BEGIN SOLUTION: only the (query, key) pairs the causal mask lets through, nothing wholly in
  //   the future, the same work on every rank with zig-zag (L10Ring.BlockPlan*; README
  //   section 3)
  b.q_len = local_len;
  b.k_len = local_len;
  if (!causal) return b;  // every query sees every key
  if (src == rank) {      // the diagonal block: the mask inside it
    b.masked = true;
    return b;
  }
  if (!zigzag) {  // contiguous chunks: an earlier rank's keys are all visible, a later one's none
    b.skip = src > rank;
    return b;
  }
  // Zig-zag: this rank holds chunks rank and 2cp-1-rank, src holds src and 2cp-1-src.
  const int64_t half = local_len / 2;
  if (src < rank) {
    b.k_len = half;  // src's first chunk comes before both of mine; its second after both
  } else {
    b.q_begin = half;  // my second chunk comes after both of src's; my first before both
    b.q_len = half;
  }
  // END SOLUTION
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
    // BEGIN SOLUTION: cp steps, each merging ring_block's part of the visiting K/V block, the
    //   next block's rotation in flight while this one is computed (L10Ring.*; README section 3
    //   hints)
    torch::Tensor kb = k.contiguous(), vb = v.contiguous();
    for (int s = 0; s < n; ++s) {
      const int src = (rank - s + n) % n;  // whose K/V this rank holds at step s
      Rotation next;
      if (s + 1 < n) next = start_rotation({kb, vb}, cp, kKvTag);  // before computing: overlap
      const RingBlock b = ring_block(rank, src, n, tl, zigzag, causal);
      if (!b.skip) {
        const torch::Tensor k_pos = local_positions(seq, src, n, zigzag);
        BlockOut part =
            block_attention(q.narrow(2, b.q_begin, b.q_len), kb.narrow(2, b.k_begin, b.k_len),
                            vb.narrow(2, b.k_begin, b.k_len), q_pos.narrow(0, b.q_begin, b.q_len),
                            k_pos.narrow(0, b.k_begin, b.k_len), b.masked);
        torch::Tensor o = out.narrow(2, b.q_begin, b.q_len);
        torch::Tensor l = lse.narrow(2, b.q_begin, b.q_len);
        merge_block(o, l, part);
      }
      if (s + 1 < n) {
        auto got = next.finish();
        kb = got[0];
        vb = got[1];
      }
    }
    // END SOLUTION
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
    // BEGIN SOLUTION: the same cp steps; every rank adds its block_attention_backward
    //   contribution to the visiting block's dK/dV, which travel one hop a step, cp hops in all,
    //   the last bringing them home (L10Ring.*; README section 3 hints)
    torch::Tensor kb = k.contiguous(), vb = v.contiguous();
    torch::Tensor dkb = torch::zeros(k.sizes(), dq.options());
    torch::Tensor dvb = torch::zeros(v.sizes(), dq.options());
    Rotation grads;  // the accumulators on their way to the next rank
    bool in_flight = false;
    for (int s = 0; s < n; ++s) {
      const int src = (rank - s + n) % n;
      Rotation next;
      if (s + 1 < n) next = start_rotation({kb, vb}, cp, kKvTag);
      const RingBlock b = ring_block(rank, src, n, tl, zigzag, causal);
      BlockGrads g;
      if (!b.skip) {
        const torch::Tensor k_pos = local_positions(seq, src, n, zigzag);
        g = block_attention_backward(
            q.narrow(2, b.q_begin, b.q_len), kb.narrow(2, b.k_begin, b.k_len),
            vb.narrow(2, b.k_begin, b.k_len), q_pos.narrow(0, b.q_begin, b.q_len),
            k_pos.narrow(0, b.k_begin, b.k_len), b.masked, out.narrow(2, b.q_begin, b.q_len),
            lse.narrow(2, b.q_begin, b.q_len), dout.narrow(2, b.q_begin, b.q_len));
        dq.narrow(2, b.q_begin, b.q_len).add_(g.dq);
      }
      if (in_flight) {  // block src's accumulator, from the rank that held it last step
        auto got = grads.finish();
        dkb = got[0];
        dvb = got[1];
      }
      if (!b.skip) {
        dkb.narrow(2, b.k_begin, b.k_len).add_(g.dk);
        dvb.narrow(2, b.k_begin, b.k_len).add_(g.dv);
      }
      grads = start_rotation({dkb, dvb}, cp, kGradTag);
      in_flight = true;
      if (s + 1 < n) {
        auto got = next.finish();
        kb = got[0];
        vb = got[1];
      }
    }
    auto home = grads.finish();  // after cp rotations each accumulator is back with its owner
    dk = home[0];
    dv = home[1];
    // END SOLUTION
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
  // BEGIN SOLUTION: (B, H, Tl, D) -> (B, H/cp, cp Tl, D): this rank's heads, every rank's tokens
  //   in rank order, with one alltoall (L10Ulysses.*; README section 4 hints)
  const int64_t B = x.size(0), tl = x.size(2), D = x.size(3);
  // Slice j of the first dimension = the heads of rank j: (cp, B, H/cp, Tl, D).
  const torch::Tensor send = x.reshape({B, n, H / n, tl, D}).permute({1, 0, 2, 3, 4});
  const torch::Tensor got = all_to_all(send, cp);  // slice j: rank j's tokens of my heads
  return got.permute({1, 2, 0, 3, 4}).reshape({B, H / n, n * tl, D});
  // END SOLUTION
}

torch::Tensor heads_to_seq_impl(const torch::Tensor& x, Comm& cp) {
  // BEGIN SOLUTION: (B, H/cp, cp Tl, D) -> (B, H, Tl, D), undoing seq_to_heads exactly, with one
  //   alltoall (L10Ulysses.*; README section 4 hints)
  const int n = cp.getSize();
  const int64_t B = x.size(0), hl = x.size(1), tl = x.size(2) / n, D = x.size(3);
  // Slice j = rank j's tokens of my heads: (cp, B, H/cp, Tl, D).
  const torch::Tensor send = x.reshape({B, hl, n, tl, D}).permute({2, 0, 1, 3, 4});
  const torch::Tensor got = all_to_all(send, cp);  // slice j: rank j's heads of my tokens
  return got.permute({1, 0, 2, 3, 4}).reshape({B, n * hl, tl, D});
  // END SOLUTION
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
    // BEGIN SOLUTION: (B, H, Tl, D) -> (B, H, cp Tl, D), rank j's rows at [j Tl, (j+1) Tl), with
    //   one allgather (L10AllGather.*; README section 5 hints)
    std::vector<torch::Tensor> input{x.contiguous()};
    std::vector<std::vector<torch::Tensor>> output(1);
    for (int j = 0; j < cp.getSize(); ++j) output[0].push_back(torch::empty_like(input[0]));
    cp.allgather(output, input)->wait();
    return torch::cat(output[0], /*dim=*/2);
    // END SOLUTION
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    [[maybe_unused]] Comm& cp = comm_of(ctx);
    // BEGIN SOLUTION: the gradient of this rank's rows summed over every rank's copy, with one
    //   alltoall (L10AllGather.*; README section 5 hints)
    const int n = cp.getSize();
    const torch::Tensor grad = g[0];  // (B, H, cp Tl, D): every rank's rows, on this rank
    // Slice j of the first dimension: rank j's rows, for rank j.
    const auto sizes = grad.sizes();
    const torch::Tensor send =
        grad.reshape({sizes[0], sizes[1], n, sizes[2] / n, sizes[3]}).permute({2, 0, 1, 3, 4});
    const torch::Tensor got = all_to_all(send, cp);  // slice j: rank j's gradient of my rows
    return {got.sum(0), torch::Tensor()};
    // END SOLUTION
  }
};

}  // namespace

torch::Tensor gather_sequence(const torch::Tensor& x, Comm& cp) {
  return GatherSequenceFn::apply(x, comm_handle(cp));
}

}  // namespace dtc::l10
