// Lesson 13: expert parallelism. Fill in the TODO(L13) regions; moe.h says what each function
// must do, README.md teaches it, and `make test-lesson13` checks it.
#include "moe.h"

#include <fmt/format.h>

#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dtc/todo.h"

namespace dtc::l13 {

namespace {

int64_t sum_of(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

std::vector<int64_t> to_vector(const torch::Tensor& t) {
  const torch::Tensor c = t.to(torch::kCPU, torch::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// The collective itself: x's rows [sum(send[0..q)), + send[q]) to rank q, recv[q] rows from it.
torch::Tensor exchange(const torch::Tensor& x, std::vector<int64_t> send, std::vector<int64_t> recv,
                       Comm& comm) {
  // TODO(L13)
  DTC_TODO("L13",
           "post one alltoall_base over comm with these splits (output splits first) into "
           "a new tensor of sum(recv) rows, and wait for it");
}

// The all-to-all as an autograd function: its backward is the all-to-all the other way.
class AllToAllFunction : public torch::autograd::Function<AllToAllFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               std::vector<int64_t> send, std::vector<int64_t> recv, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return exchange(x, std::move(send), std::move(recv), comm_from(comm));
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const std::vector<int64_t> send = ctx->saved_data["send"].toIntVector();
    const std::vector<int64_t> recv = ctx->saved_data["recv"].toIntVector();
    // TODO(L13)
    DTC_TODO("L13",
             "send each row's gradient back to the rank its row came from: the "
             "all-to-all with the splits swapped");
  }
};

}  // namespace

torch::Tensor all_to_all(const torch::Tensor& x, const std::vector<int64_t>& send_splits,
                         const std::vector<int64_t>& recv_splits, Comm& comm) {
  const auto n = static_cast<size_t>(comm.getSize());
  if (send_splits.size() != n || recv_splits.size() != n) {
    throw std::invalid_argument(fmt::format(
        "all_to_all: {} send and {} receive splits for a group of {}: one of each per rank",
        send_splits.size(), recv_splits.size(), n));
  }
  if (x.dim() < 1 || sum_of(send_splits) != x.size(0)) {
    throw std::invalid_argument(
        fmt::format("all_to_all: the send splits sum to {} but x has {} rows", sum_of(send_splits),
                    x.dim() < 1 ? 0 : x.size(0)));
  }
  return AllToAllFunction::apply(x, send_splits, recv_splits, comm_handle(comm));
}

torch::Tensor exchange_counts(const torch::Tensor& send_counts, Comm& ep) {
  const int64_t p = ep.getSize();
  if (send_counts.dim() != 1 || send_counts.size(0) % p != 0) {
    throw std::invalid_argument(
        fmt::format("exchange_counts: send_counts must be (E,) with E a multiple of ep {}, not {}",
                    p, c10::str(send_counts.sizes())));
  }
  // TODO(L13)
  DTC_TODO("L13",
           "each rank sends the counts of the experts of rank q to rank q (E/P of them), "
           "and receives from every rank its counts for this rank's experts: (P, E/P)");
}

Dispatch dispatch(const torch::Tensor& x, const Routing& routing, int64_t experts, Comm& ep) {
  const int64_t p = ep.getSize();
  if (experts % p != 0) {
    throw std::invalid_argument(
        fmt::format("dispatch: {} experts do not split over ep {}", experts, p));
  }
  Dispatch d;
  // TODO(L13)
  DTC_TODO("L13",
           "order the kept copies by expert (and so by ep rank), exchange the counts, "
           "send each copy's token to its expert's rank, and regroup what arrives (rank by rank, "
           "each "
           "rank's by expert) by local expert");
  return d;
}

torch::Tensor combine(const torch::Tensor& expert_out, const Dispatch& d, const Routing& routing,
                      Comm& ep) {
  if (expert_out.size(0) != d.tokens.size(0)) {
    throw std::invalid_argument(fmt::format("combine: {} expert rows for {} dispatched",
                                            expert_out.size(0), d.tokens.size(0)));
  }
  // TODO(L13)
  DTC_TODO("L13",
           "undo the regrouping, send each result back to the rank it came from (the "
           "all-to-all the other way), and add each copy's result times its router weight into "
           "its "
           "token's row");
}

torch::Tensor moe_loss(const torch::Tensor& ce, const std::vector<RouterStats>& stats,
                       const MoeConfig& config, Comm& data) {
  torch::Tensor loss = ce;
  // TODO(L13)
  DTC_TODO("L13",
           "add each layer's Switch loss (f from the whole job's choices, one collective "
           "for every layer; P from this rank's tokens) and its z-loss");
  return loss;
}

void reduce_gradients(const std::vector<std::pair<std::string, torch::Tensor>>& params, Comm& data,
                      Comm& expert_data) {
  // TODO(L13)
  DTC_TODO("L13",
           "sum each replicated parameter's gradient over every rank and each expert's "
           "over the ranks that hold it, and divide both by the number of ranks the global batch "
           "was "
           "cut into (every rank's tokens reached every expert through the all-to-all)");
}

void update_expert_bias(torch::Tensor& bias, const torch::Tensor& counts, double rate, Comm& data) {
  // TODO(L13)
  DTC_TODO("L13",
           "the whole job's choices per expert (one collective), then each expert's bias "
           "up by rate when it was chosen less than the mean, down when more, unchanged at the "
           "mean");
}

}  // namespace dtc::l13
// generated from solutions/13_moe/moe.cpp; checksum 5c674862b5e9a555
