// Lesson 06 (given): the Reducer's bucket rebuild, its shadow step and compression hook, the
// launch of a bucket's allreduce, the unused-parameter search before backward, and the
// sampler's constructor. Your part is in ddp.cpp; both implement ddp.h.
#include <fmt/format.h>

#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <unordered_set>
#include <utility>

#include "ddp.h"
#include "dtc/compat.h"
#include "dtc/errors.h"

namespace dtc::l06 {

void Reducer::rebuild_buckets() {
  const size_t n = params_.size();
  // The order this rank saw, then the parameters whose gradient never came (unused in that
  // step), last index first, as the constructor's buckets have them.
  std::vector<int64_t> order;
  std::vector<bool> seen(n, false);
  for (int64_t i : ready_order_) {
    if (!seen[static_cast<size_t>(i)]) {
      seen[static_cast<size_t>(i)] = true;
      order.push_back(i);
    }
  }
  for (size_t i = n; i-- > 0;) {
    if (!seen[i]) order.push_back(static_cast<int64_t>(i));
  }
  // Rank 0's order on every rank (autograd may finish gradients in another order on another
  // rank, and the buckets, and so the collectives, must be the same everywhere).
  // (On the parameters' device: NCCL takes no CPU tensors.)
  std::vector<at::Tensor> shared{torch::tensor(order, torch::kLong).to(params_.front().device())};
  comm_->broadcast(shared)->wait();
  const auto got = shared[0].cpu().contiguous();
  const int64_t* o = got.data_ptr<int64_t>();
  // assign_buckets walks its list from the end: give it order[from..n) last-ready first, and
  // map its indices back (its j is order[n - 1 - j]).
  auto along = [&](size_t from, int64_t cap) {
    std::vector<torch::Tensor> reversed;
    for (size_t k = n; k-- > from;) reversed.push_back(params_[static_cast<size_t>(o[k])]);
    auto local =
        reversed.empty() ? std::vector<std::vector<size_t>>{} : assign_buckets(reversed, cap);
    for (auto& bucket : local) {
      for (auto& j : bucket) j = static_cast<size_t>(o[n - 1 - j]);
    }
    return local;
  };
  std::vector<std::vector<size_t>> buckets;
  auto first = along(0, first_bucket_bytes_);
  if (!first.empty()) {
    buckets.push_back(first.front());
    for (auto& bucket : along(buckets.front().size(), bucket_bytes_)) buckets.push_back(bucket);
  }
  buckets_ = std::move(buckets);
  lay_out();
  for (size_t i = 0; i < order_hook_ids_.size(); ++i) params_[i].remove_hook(order_hook_ids_[i]);
  order_hook_ids_.clear();
  ready_order_.clear();
  rebuilt_ = true;
}

void Reducer::shadow_step() {
  if (find_unused_) {  // the others' used map first (prepare_for_backward): this rank used nothing
    std::vector<at::Tensor> used{
        torch::zeros({static_cast<int64_t>(params_.size())},
                     torch::dtype(torch::kInt).device(params_.front().device()))};
    comm_->allreduce(used)->wait();
  }
  for (size_t b = 0; b < flat_.size(); ++b) {  // the buckets in launch order, as the others'
    flat_[b].zero_();
    launch(b);  // in the hook's dtype, if there is one
    work_[b]->wait();
  }
  // The others rebuild after their first step: take part in its broadcast (with no ready order
  // of its own, this rank offers reverse registration order, used only if it is rank 0), as
  // DDP's join hook does (_rebuild_buckets in main_hook).
  if (rebuild_due()) rebuild_buckets();
}

Reducer::~Reducer() {
  for (size_t i = 0; i < hook_ids_.size(); ++i) params_[i].remove_hook(hook_ids_[i]);
  for (size_t i = 0; i < order_hook_ids_.size(); ++i) params_[i].remove_hook(order_hook_ids_[i]);
}

namespace {

// The compression hook's Work: the 16-bit allreduce, then the cast back into the fp32 bucket
// (PyTorch's decompress callback on the hook's future), done by the first wait() or by
// isCompleted() once the allreduce is. It owns the 16-bit copy until then.
class DecompressWork : public c10d::Work {
 public:
  DecompressWork(c10::intrusive_ptr<c10d::Work> inner, torch::Tensor wire, torch::Tensor flat)
      : inner_(std::move(inner)), wire_(std::move(wire)), flat_(std::move(flat)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    decompress();
    return true;
  }
  // Completed once the allreduce is and the bucket holds its result: a poll from another
  // thread (a watcher, a recorder) decompresses at most once, under the lock, as wait() does.
  bool isCompleted() override {
    if (!inner_->isCompleted() || !inner_->isSuccess()) return false;
    decompress();
    return true;
  }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }

 private:
  void decompress() {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    torch::NoGradGuard no_grad;
    flat_.copy_(wire_);
    wire_ = torch::Tensor();  // the 16-bit copy goes once it is read, as PyTorch's does
    done_ = true;
  }

  c10::intrusive_ptr<c10d::Work> inner_;
  torch::Tensor wire_, flat_;
  std::mutex mu_;
  bool done_ = false;  // guarded by mu_
};

}  // namespace

void Reducer::register_compress_hook(torch::ScalarType wire_dtype) {
  if (wire_dtype != torch::kBFloat16 && wire_dtype != torch::kHalf) {
    throw UsageError("--reduce-dtype", "a compression hook sends bf16 or fp16",
                     "pass --reduce-dtype bf16 or fp16 (fp32: no hook)");
  }
  if (wire_dtype == torch::kBFloat16 && !kGlooBf16 && comm_->getBackendName() == "gloo") {
    throw UsageError("--reduce-dtype",
                     fmt::format("gloo in LibTorch {} has no bf16 allreduce", torch_version()),
                     "pass --reduce-dtype fp16, or use LibTorch 2.x or --backend nccl");
  }
  if (compressed()) throw std::logic_error("the Reducer has a compression hook already");
  const bool mid_step = next_to_launch_ != 0 ||
                        std::any_of(work_.begin(), work_.end(), [](const auto& w) { return w; });
  if (mid_step)
    throw std::logic_error("register the compression hook before a backward, not in one");
  wire_dtype_ = wire_dtype;
}

void Reducer::launch(size_t b) {
  if (!compressed()) {
    std::vector<at::Tensor> tensors{flat_[b]};
    work_[b] = comm_->allreduce(tensors);  // asynchronous: returns at once, runs on gloo's threads
    return;
  }
  // bf16/fp16_compress_hook: compress, pre-divide, allreduce; decompress when it completes.
  torch::NoGradGuard no_grad;
  auto wire = flat_[b].to(wire_dtype_).div_(static_cast<double>(comm_->getSize()));
  std::vector<at::Tensor> tensors{wire};
  work_[b] = c10::make_intrusive<DecompressWork>(comm_->allreduce(tensors), wire, flat_[b]);
}

torch::Tensor Reducer::slot(size_t index) const {
  const auto& p = params_[index];
  return flat_[bucket_of_[index]]
      .slice(0, offset_of_[index], offset_of_[index] + p.numel())
      .view_as(p);
}

void Reducer::prepare_for_backward(const torch::Tensor& output) {
  if (!sync_) return;
  // The parameters this step's graph reaches: its AccumulateGrad nodes' variables.
  std::unordered_set<const void*> reached;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  if (output.grad_fn()) stack.push_back(output.grad_fn().get());
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      reached.insert(acc->variable.unsafeGetTensorImpl());
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ready_[i] || reached.count(params_[i].unsafeGetTensorImpl()) > 0) continue;
    const auto& p = params_[i];
    const size_t b = bucket_of_[i];
    auto slot = this->slot(i);
    if (p.grad().defined()) {
      slot.copy_(p.grad());
    } else {
      slot.zero_();
    }
    ready_[i] = true;
    --pending_[b];
  }
  // The used map, summed over the ranks while backward runs (before any bucket is launched, so
  // that every rank issues the two in the same order); unused() waits for it.
  std::vector<int32_t> used(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    used[i] = reached.count(params_[i].unsafeGetTensorImpl()) > 0 || params_[i].grad().defined();
  }
  used_map_ = torch::tensor(used, torch::kInt).to(params_.front().device());
  std::vector<at::Tensor> shared{used_map_};
  used_work_ = comm_->allreduce(shared);
  find_unused_ = true;
  while (next_to_launch_ < buckets_.size() && pending_[next_to_launch_] == 0) {
    launch(next_to_launch_++);
  }
}

std::vector<bool> Reducer::unused() {
  std::vector<bool> nobody(params_.size(), false);
  if (!used_work_) return nobody;
  used_work_->wait();
  used_work_.reset();
  const auto sum = used_map_.cpu().contiguous();
  for (size_t i = 0; i < params_.size(); ++i) nobody[i] = sum.data_ptr<int32_t>()[i] == 0;
  return nobody;
}

std::vector<int64_t> randperm(int64_t n, uint64_t seed) {
  // PyTorch: g = torch.Generator(); g.manual_seed(seed); torch.randperm(n, generator=g).
  // The same CPU generator (mt19937) and the same randperm kernel give the same permutation
  // (checked against PyTorch 2.15 and 1.13 in tests/reference/lesson06_sampler.json).
  auto generator = at::detail::createCPUGenerator(seed);
  const auto perm = torch::randperm(n, generator, torch::kLong);
  return std::vector<int64_t>(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + n);
}

DistributedSampler::DistributedSampler(int64_t size, int num_replicas, int rank, bool shuffle,
                                       uint64_t seed, bool drop_last)
    : size_(size),
      num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  if (size < 1) {
    throw UsageError("dataset", fmt::format("{} samples: nothing to sample", size),
                     "use a longer corpus or a shorter --seq");
  }
  if (num_replicas < 1 || rank < 0 || rank >= num_replicas) {
    throw UsageError("rank", fmt::format("rank {} of {} replicas", rank, num_replicas),
                     "the rank must be in [0, num_replicas)");
  }
}

}  // namespace dtc::l06
