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
  // BEGIN SOLUTION: post one alltoall_base over comm with these splits (output splits first) into
  //   a new tensor of sum(recv) rows, and wait for it
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes[0] = sum_of(recv);
  torch::Tensor out = torch::empty(sizes, x.options());
  torch::Tensor in = x.contiguous();
  comm.alltoall_base(out, in, recv, send)->wait();
  return out;
  // END SOLUTION
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
    // BEGIN SOLUTION: send each row's gradient back to the rank its row came from: the
    //   all-to-all with the splits swapped
    return {exchange(grads[0], recv, send, comm_of(ctx)), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
    // END SOLUTION
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
  // BEGIN SOLUTION: each rank sends the counts of the experts of rank q to rank q (E/P of them),
  //   and receives from every rank its counts for this rank's experts: (P, E/P)
  const int64_t local = send_counts.size(0) / p;
  const std::vector<int64_t> even(static_cast<size_t>(p), local);
  torch::NoGradGuard no_grad;
  return exchange(send_counts.to(torch::kLong), even, even, ep).reshape({p, local});
  // END SOLUTION
}

Dispatch dispatch(const torch::Tensor& x, const Routing& routing, int64_t experts, Comm& ep) {
  const int64_t p = ep.getSize();
  if (experts % p != 0) {
    throw std::invalid_argument(
        fmt::format("dispatch: {} experts do not split over ep {}", experts, p));
  }
  Dispatch d;
  // BEGIN SOLUTION: order the kept copies by expert (and so by ep rank), exchange the counts,
  //   send each copy's token to its expert's rank, and regroup what arrives (rank by rank, each
  //   rank's by expert) by local expert
  const int64_t k = routing.experts.size(1);
  const int64_t local = experts / p;
  const torch::Tensor flat = routing.experts.reshape({-1});
  const torch::Tensor kept = torch::nonzero(routing.keep.reshape({-1})).reshape({-1});
  const torch::Tensor order =
      std::get<1>(torch::sort(flat.index_select(0, kept), /*stable=*/true, 0, false));
  d.copies = kept.index_select(0, order);
  const torch::Tensor send_counts =
      torch::bincount(flat.index_select(0, d.copies), {}, experts).to(torch::kLong);
  const torch::Tensor recv = exchange_counts(send_counts, ep);  // (P, E/P)
  d.send_splits = to_vector(send_counts.reshape({p, local}).sum(1));
  d.recv_splits = to_vector(recv.sum(1));
  const torch::Tensor received = all_to_all(x.index_select(0, torch::floor_divide(d.copies, k)),
                                            d.send_splits, d.recv_splits, ep);
  // received: rank 0's copies (its for local expert 0, then 1, ...), then rank 1's, ...
  const std::vector<int64_t> counts = to_vector(recv.reshape({-1}));  // [q * local + j]
  std::vector<int64_t> start(counts.size());
  int64_t at = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    start[i] = at;
    at += counts[i];
  }
  std::vector<torch::Tensor> rows;
  for (int64_t j = 0; j < local; ++j) {
    int64_t n = 0;
    for (int64_t q = 0; q < p; ++q) {
      const size_t i = static_cast<size_t>(q * local + j);
      rows.push_back(torch::arange(start[i], start[i] + counts[i], torch::kLong));
      n += counts[i];
    }
    d.tokens_per_expert.push_back(n);
  }
  d.regroup = torch::cat(rows).to(x.device());
  d.tokens = received.index_select(0, d.regroup);
  // END SOLUTION
  return d;
}

torch::Tensor combine(const torch::Tensor& expert_out, const Dispatch& d, const Routing& routing,
                      Comm& ep) {
  if (expert_out.size(0) != d.tokens.size(0)) {
    throw std::invalid_argument(fmt::format("combine: {} expert rows for {} dispatched",
                                            expert_out.size(0), d.tokens.size(0)));
  }
  // BEGIN SOLUTION: undo the regrouping, send each result back to the rank it came from (the
  //   all-to-all the other way), and add each copy's result times its router weight into its
  //   token's row
  const int64_t n = routing.experts.size(0);
  const int64_t k = routing.experts.size(1);
  const torch::Tensor back =
      expert_out.index_select(0, std::get<1>(torch::sort(d.regroup, false, 0, false)));
  const torch::Tensor returned = all_to_all(back, d.recv_splits, d.send_splits, ep);
  const torch::Tensor weight =
      routing.weights.reshape({-1}).index_select(0, d.copies).unsqueeze(1).to(returned.dtype());
  return torch::zeros({n, expert_out.size(1)}, returned.options())
      .index_add(0, torch::floor_divide(d.copies, k), returned * weight);
  // END SOLUTION
}

torch::Tensor moe_loss(const torch::Tensor& ce, const std::vector<RouterStats>& stats,
                       const MoeConfig& config, Comm& data) {
  torch::Tensor loss = ce;
  // BEGIN SOLUTION: add each layer's Switch loss (f from the whole job's choices, one collective
  //   for every layer; P from this rank's tokens) and its z-loss
  if (config.balance == Balance::kAux && !stats.empty()) {
    std::vector<torch::Tensor> counts;
    for (const RouterStats& s : stats) counts.push_back(s.counts.to(torch::kDouble));
    std::vector<torch::Tensor> global{torch::stack(counts)};  // on the counts' device (NCCL: GPU)
    data.allreduce(global)->wait();
    const torch::Tensor f = global[0] / global[0].sum(1, /*keepdim=*/true);  // (L, E)
    for (size_t i = 0; i < stats.size(); ++i) {
      const torch::Tensor fi =
          f[static_cast<int64_t>(i)].to(stats[i].shares.device(), torch::kFloat);
      loss = loss + config.aux_coef * static_cast<double>(config.experts) *
                        (fi * stats[i].shares.mean(0)).sum();
    }
  }
  if (config.z_coef > 0) {
    for (const RouterStats& s : stats) {
      loss = loss + config.z_coef * torch::logsumexp(s.logits, -1).pow(2).mean();
    }
  }
  // END SOLUTION
  return loss;
}

void reduce_gradients(const std::vector<std::pair<std::string, torch::Tensor>>& params, Comm& data,
                      Comm& expert_data) {
  // BEGIN SOLUTION: sum each replicated parameter's gradient over every rank and each expert's
  //   over the ranks that hold it, and divide both by the number of ranks the global batch was
  //   cut into (every rank's tokens reached every expert through the all-to-all)
  const double world = data.getSize();
  for (const bool expert : {false, true}) {
    std::vector<torch::Tensor> grads;
    for (const auto& [name, p] : params) {
      if (is_expert(name) != expert) continue;
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      grads.push_back(p.grad());
    }
    if (grads.empty()) continue;
    std::vector<torch::Tensor> flat{torch::cat([&] {
      std::vector<torch::Tensor> v;
      for (const auto& g : grads) v.push_back(g.reshape({-1}));
      return v;
    }())};
    (expert ? expert_data : data).allreduce(flat)->wait();
    flat[0].div_(world);
    int64_t at = 0;
    for (auto& g : grads) {
      g.copy_(flat[0].narrow(0, at, g.numel()).view_as(g));
      at += g.numel();
    }
  }
  // END SOLUTION
}

void update_expert_bias(torch::Tensor& bias, const torch::Tensor& counts, double rate, Comm& data) {
  // BEGIN SOLUTION: the whole job's choices per expert (one collective), then each expert's bias
  //   up by rate when it was chosen less than the mean, down when more, unchanged at the mean
  std::vector<torch::Tensor> global{counts.to(torch::kDouble).clone()};
  data.allreduce(global)->wait();
  const torch::Tensor load = global[0];
  bias.add_((rate * torch::sign(load.mean() - load)).to(bias.device(), bias.scalar_type()));
  // END SOLUTION
}

}  // namespace dtc::l13
