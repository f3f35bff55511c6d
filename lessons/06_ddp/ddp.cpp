// Lesson 06: your first DDP, built by hand. Implements lessons/06_ddp/ddp.h.
//
// Fill in every TODO(L06) below, top to bottom; `make test-lesson06` runs 2 and 3 thread-ranks
// of your DDP against a single-process baseline and PyTorch's losses, checks your sampler
// against PyTorch's DistributedSampler, and resumes from your checkpoint. Then run the program:
//
//   make run-lesson06 ARGS="--steps 20 --seed 1"     # torchrun, 2 ranks (README section 3)
#include "ddp.h"

#include <fmt/format.h>

#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <unordered_set>
#include <utility>

#include "dtc/compat.h"
#include "dtc/errors.h"
#include "dtc/todo.h"

namespace dtc::l06 {

// ---------------------------------------------------------------------------------------------
// Step 2: an identical start
// ---------------------------------------------------------------------------------------------

void broadcast_parameters(torch::nn::Module& module, Comm& comm) {
  // TODO(L06)
  DTC_TODO("L06",
           "every parameter, then every buffer, must end equal to rank 0's, written in "
           "place and outside autograd (L06Broadcast.*; hints: README step 2, \"The calls you "
           "need\")");
}

// ---------------------------------------------------------------------------------------------
// Steps 3 and 4: averaging after backward
// ---------------------------------------------------------------------------------------------

void allreduce_gradients_naive(const std::vector<torch::Tensor>& params, Comm& comm) {
  // TODO(L06)
  DTC_TODO("L06",
           "one collective per parameter with a defined grad; on return each such grad is "
           "the mean over ranks: grads 1, 2, ..., W give (W + 1) / 2 (L06Naive.*; hints: README "
           "step 3)");
}

void allreduce_gradients_flat(const std::vector<torch::Tensor>& params, Comm& comm) {
  // TODO(L06)
  DTC_TODO("L06",
           "the naive version's means with ONE collective for all defined grads; each "
           "p.grad() keeps its shape (L06Flat.*; hints: README step 4)");
}

// ---------------------------------------------------------------------------------------------
// Step 5: buckets, overlapped with backward
// ---------------------------------------------------------------------------------------------

std::vector<std::vector<size_t>> assign_buckets(const std::vector<torch::Tensor>& params,
                                                int64_t bucket_bytes) {
  if (bucket_bytes < 1) {
    throw UsageError("--bucket-kb",
                     fmt::format("a bucket cap of {} bytes is too small", bucket_bytes),
                     "pass a positive size, e.g. --bucket-kb 1024 (PyTorch's default is 25 MB)");
  }
  std::vector<std::vector<size_t>> buckets;
  // TODO(L06)
  DTC_TODO("L06",
           "ddp.h's buckets: the first one holds the LAST parameters, each is closed once "
           "its bytes reach bucket_bytes, no parameter is split (L06Buckets.*; hints: README "
           "step 5)");
  return buckets;
}

Reducer::Reducer(std::vector<torch::Tensor> params, c10::intrusive_ptr<Comm> comm,
                 int64_t bucket_bytes, int64_t first_bucket_bytes)
    : params_(std::move(params)),
      comm_(std::move(comm)),
      bucket_bytes_(bucket_bytes),
      first_bucket_bytes_(first_bucket_bytes) {
  if (first_bucket_bytes < 0) {
    throw UsageError("--first-bucket-kb",
                     fmt::format("a first bucket of {} bytes is negative", first_bucket_bytes),
                     "pass a positive size, e.g. --first-bucket-kb 64 (PyTorch's: 1 MiB)");
  }
  buckets_ = assign_buckets(params_, bucket_bytes);
  const size_t n = params_.size();
  ready_.assign(n, false);
  lay_out();
  if (first_bucket_bytes_ > 0) {
    // The order the gradients arrive in, for the rebuild: hooks registered before the
    // Reducer's own, so they run first (a tensor's hooks run in registration order).
    for (size_t i = 0; i < n; ++i) {
      order_hook_ids_.push_back(params_[i].register_hook([this, i](const torch::Tensor&) {
        if (sync_ && rebuild_due()) ready_order_.push_back(static_cast<int64_t>(i));
      }));
    }
  }
  // TODO(L06)
  DTC_TODO("L06",
           "parameter i needs one hook that calls on_grad(i, grad), its id kept for the "
           "destructor (L06Bucketed.*; hints: README step 5)");
}

void Reducer::lay_out() {
  const size_t n = params_.size();
  bucket_of_.assign(n, 0);
  offset_of_.assign(n, 0);
  flat_.clear();
  pending_.resize(buckets_.size());  // no parameter of any bucket is ready yet
  for (size_t b = 0; b < buckets_.size(); ++b) {
    pending_[b] = static_cast<int64_t>(buckets_[b].size());
  }
  work_.assign(buckets_.size(), {});
  next_to_launch_ = 0;
  // TODO(L06)
  DTC_TODO("L06",
           "parameter i needs a slot (bucket_of_, offset_of_) in its bucket's flat zero "
           "buffer (the parameters' dtype and device), one buffer per bucket in flat_ "
           "(L06Bucketed.*; hints: README step 5)");
}

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

void Reducer::on_grad(size_t index, const torch::Tensor& grad) {
  // TODO(L06)
  DTC_TODO("L06",
           "under sync, p's slot holds what p.grad() is about to hold, and each bucket "
           "launches once complete, never before an earlier one; count them in "
           "launched_in_backward_ "
           "(L06Bucketed.*, L06NoSync.*; hints: README step 5)");
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

void Reducer::finish() {
  if (!sync_) return;
  // TODO(L06)
  DTC_TODO("L06",
           "on return every p.grad() is the mean over ranks, also where no hook fired "
           "(that rank adds its p.grad() or zeros), and the next backward starts afresh; with a "
           "compression hook the hook has divided; a parameter that no rank used (unused()) "
           "keeps its "
           "p.grad() untouched (L06Bucketed.*, L06CommHook.*; hints: README step 5)");
  if (rebuild_due()) rebuild_buckets();  // once, before the next forward
}

// ---------------------------------------------------------------------------------------------
// The distributed sampler
// ---------------------------------------------------------------------------------------------

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

int64_t DistributedSampler::num_samples() const {
  // TODO(L06)
  DTC_TODO("L06",
           "PyTorch's per-rank count (ddp.h): equal on every rank, the remainder dropped "
           "with drop_last, padded up otherwise (L06Sampler.*; hints: README section 5)");
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> mine;
  // TODO(L06)
  DTC_TODO("L06",
           "exactly PyTorch's DistributedSampler indices for this rank and epoch: the "
           "ranks take disjoint positions of one order, num_samples() each (L06Sampler.*; hints: "
           "README section 5)");
  return mine;
}

// ---------------------------------------------------------------------------------------------
// Step 7: checkpoints, on rank 0 only
// ---------------------------------------------------------------------------------------------

void save_checkpoint(const std::string& path, int rank, torch::nn::Module& module,
                     torch::optim::Optimizer& optimizer, int64_t steps_done) {
  // TODO(L06)
  DTC_TODO("L06",
           "rank 0 alone writes path, atomically (never half a file, no path.tmp left), "
           "with \"model\", \"optimizer\" and \"steps_done\" (L06Checkpoint.*; hints: README "
           "section 4)");
}

int64_t load_checkpoint(const std::string& path, torch::nn::Module& module,
                        torch::optim::Optimizer& optimizer) {
  // TODO(L06)
  DTC_TODO("L06",
           "restore what save_checkpoint wrote and return steps_done: a resumed run equals "
           "the uninterrupted one bit for bit (L06Checkpoint.*; hints: README section 4)");
}

}  // namespace dtc::l06
// generated from solutions/06_ddp/ddp.cpp; checksum bc0ed0370ad56bd7
