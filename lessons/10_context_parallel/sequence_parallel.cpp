// Lesson 10, part 5: sequence parallelism. Implements
// lessons/10_context_parallel/sequence_parallel.h.
//
// Fill in the TODO(L10) regions below; `make test-lesson10` checks each operator against the
// gathered computation on 2 and 4 thread-ranks (L10SeqPar.*), then tp x cp training runs
// against the single-process baseline.
#include "sequence_parallel.h"

#include <fmt/format.h>

#include <stdexcept>
#include <vector>

#include "dtc/todo.h"

namespace dtc::l10 {

namespace F = torch::nn::functional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// ---------------------------------------------------------------------------------------------
// Part 5: sequence parallelism's two operators
// ---------------------------------------------------------------------------------------------

// (B, T, ...) partial sums on every TP rank -> rows [t T/tp, (t+1) T/tp) of their sum.
torch::Tensor reduce_scatter_rows(const torch::Tensor& x, Comm& tp) {
  // TODO(L10)
  DTC_TODO("L10",
           "rank t gets rows [t T/tp, (t+1) T/tp) of the sum over the TP ranks of x, "
           "(B, T/tp, ...), with one alltoall (L10SeqPar.ReduceScatter*; README section 9 hints)");
}

// (B, T/tp, ...) on every TP rank -> (B, T, ...): rank j's rows at [j T/tp, (j+1) T/tp).
torch::Tensor all_gather_rows(const torch::Tensor& x, Comm& tp) {
  // TODO(L10)
  DTC_TODO("L10",
           "every TP rank's rows in rank order along dimension 1, with one allgather "
           "(L10SeqPar.*; README section 9 hints)");
}

// g-bar: forward reduce-scatter, backward all-gather (given).
struct ReduceScatterSequenceFn : public torch::autograd::Function<ReduceScatterSequenceFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return reduce_scatter_rows(x, comm_from(comm));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather_rows(grads[0], comm_of(ctx)), torch::Tensor()};
  }
};

// g (forward all-gather, backward reduce-scatter) and the column-parallel Linear in one,
// saving only this rank's rows.
struct GatherLinearFn : public torch::autograd::Function<GatherLinearFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias,
                               int64_t comm) {
    ctx->saved_data["comm"] = comm;
    const bool has_bias = bias.numel() > 0;  // no bias: an empty tensor (see gather_linear)
    ctx->saved_data["bias"] = has_bias;
    [[maybe_unused]] Comm& tp = comm_from(comm);
    // TODO(L10)
    DTC_TODO("L10",
             "the Linear of every TP rank's rows gathered along the sequence; save only "
             "this rank's rows (and the weight) for backward (L10SeqPar.GatherLinear*; README "
             "section 9 "
             "hints)");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    [[maybe_unused]] Comm& tp = comm_of(ctx);
    [[maybe_unused]] const bool has_bias = ctx->saved_data["bias"].toBool();
    const torch::Tensor dy = grads[0];  // (B, T, out/tp)
    torch::Tensor dx, dweight, dbias;
    // TODO(L10)
    DTC_TODO("L10",
             "gather the rows again; dX = dY W summed over the TP ranks onto this rank's "
             "rows; dW = dY^T X and db over every row (L10SeqPar.GatherLinear*; README section 9 "
             "hints)");
    return {dx, dweight, dbias, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor reduce_scatter_sequence(const torch::Tensor& x, Comm& tp) {
  if (x.dim() < 2 || x.size(1) % tp.getSize() != 0) {
    throw std::invalid_argument(
        fmt::format("reduce_scatter_sequence: {} rows do not split over tp {}",
                    x.dim() < 2 ? 0 : x.size(1), tp.getSize()));
  }
  return ReduceScatterSequenceFn::apply(x, comm_handle(tp));
}

torch::Tensor gather_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const torch::Tensor& bias, Comm& tp) {
  // An autograd function's inputs must be defined tensors: no bias travels as an empty one.
  return GatherLinearFn::apply(
      x, weight, bias.defined() ? bias : torch::empty({0}, weight.options()), comm_handle(tp));
}

}  // namespace dtc::l10
// generated from solutions/10_context_parallel/sequence_parallel.cpp; checksum d0d3cdea85ceb719
