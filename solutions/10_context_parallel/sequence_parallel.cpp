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
  // BEGIN SOLUTION: rank t gets rows [t T/tp, (t+1) T/tp) of the sum over the TP ranks of x,
  //   (B, T/tp, ...), with one alltoall (L10SeqPar.ReduceScatter*; README section 9 hints)
  const int n = tp.getSize();
  const auto shape = x.sizes().vec();
  std::vector<int64_t> split = {shape[0], n, shape[1] / n};  // (B, tp, T/tp, ...)
  split.insert(split.end(), shape.begin() + 2, shape.end());
  std::vector<int64_t> order(split.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::swap(order[0], order[1]);  // slice j, the rows of rank j, first
  const torch::Tensor got = all_to_all(x.reshape(split).permute(order), tp);  // j: rank j's part
  return got.sum(0);
  // END SOLUTION
}

// (B, T/tp, ...) on every TP rank -> (B, T, ...): rank j's rows at [j T/tp, (j+1) T/tp).
torch::Tensor all_gather_rows(const torch::Tensor& x, Comm& tp) {
  // BEGIN SOLUTION: every TP rank's rows in rank order along dimension 1, with one allgather
  //   (L10SeqPar.*; README section 9 hints)
  std::vector<torch::Tensor> input{x.contiguous()};
  std::vector<std::vector<torch::Tensor>> output(1);
  for (int j = 0; j < tp.getSize(); ++j) output[0].push_back(torch::empty_like(input[0]));
  tp.allgather(output, input)->wait();
  return torch::cat(output[0], /*dim=*/1);
  // END SOLUTION
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
    // BEGIN SOLUTION: the Linear of every TP rank's rows gathered along the sequence; save only
    //   this rank's rows (and the weight) for backward (L10SeqPar.GatherLinear*; README section 9
    //   hints)
    ctx->save_for_backward({x, weight});  // the shard, not the gathered copy
    return F::linear(all_gather_rows(x, tp), weight, has_bias ? bias : torch::Tensor());
    // END SOLUTION
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    [[maybe_unused]] Comm& tp = comm_of(ctx);
    [[maybe_unused]] const bool has_bias = ctx->saved_data["bias"].toBool();
    const torch::Tensor dy = grads[0];  // (B, T, out/tp)
    torch::Tensor dx, dweight, dbias;
    // BEGIN SOLUTION: gather the rows again; dX = dY W summed over the TP ranks onto this rank's
    //   rows; dW = dY^T X and db over every row (L10SeqPar.GatherLinear*; README section 9 hints)
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor full = all_gather_rows(saved[0], tp);  // (B, T, in), again
    dx = reduce_scatter_rows(dy.matmul(saved[1]), tp);  // each rank holds some output features
    const auto dy2 = dy.reshape({-1, dy.size(-1)});
    dweight = dy2.t().matmul(full.reshape({-1, full.size(-1)}));
    if (has_bias) dbias = dy2.sum(0);
    // END SOLUTION
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
