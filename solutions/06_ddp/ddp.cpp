// Lesson 06: your first DDP, built by hand. Implements lessons/06_ddp/ddp.h.
//
// Fill in every TODO(L06) below, top to bottom; `make test-lesson06` runs 2 and 3 thread-ranks
// of your DDP against a single-process baseline and PyTorch's losses, checks your sampler
// against PyTorch's DistributedSampler, and resumes from your checkpoint. Then run the program:
//
//   make run-lesson06 ARGS="--steps 20 --seed 1"     # torchrun, 2 ranks (README section 3)
//
// The Reducer's bucket rebuild, shadow step, compression hook and unused-parameter search, and
// the sampler's constructor, are given, in ddp_given.cpp.
#include "ddp.h"

#include <fmt/format.h>

#include <utility>

#include "dtc/compat.h"
#include "dtc/errors.h"
#include "dtc/todo.h"

namespace dtc::l06 {

// ---------------------------------------------------------------------------------------------
// Step 2: an identical start
// ---------------------------------------------------------------------------------------------

void broadcast_parameters(torch::nn::Module& module, Comm& comm) {
  // BEGIN SOLUTION: every parameter, then every buffer, must end equal to rank 0's, written in
  //   place and outside autograd (L06Broadcast.*; hints: README step 2, "The calls you need")
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> tensors;
  for (const auto& p : module.parameters()) tensors.push_back(p.data());
  for (const auto& b : module.buffers()) tensors.push_back(b);
  for (auto& t : tensors) {
    std::vector<at::Tensor> one{t};  // broadcast writes in place: t is the parameter's storage
    comm.broadcast(one)->wait();
  }
  // END SOLUTION
}

// ---------------------------------------------------------------------------------------------
// Steps 3 and 4: averaging after backward
// ---------------------------------------------------------------------------------------------

void allreduce_gradients_naive(const std::vector<torch::Tensor>& params, Comm& comm) {
  // BEGIN SOLUTION: one collective per parameter with a defined grad; on return each such grad is
  //   the mean over ranks: grads 1, 2, ..., W give (W + 1) / 2 (L06Naive.*; hints: README step 3)
  const double world = comm.getSize();
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    std::vector<at::Tensor> grad{p.grad()};
    comm.allreduce(grad)->wait();  // SUM is AllreduceOptions' default
    p.grad().div_(world);
  }
  // END SOLUTION
}

void allreduce_gradients_flat(const std::vector<torch::Tensor>& params, Comm& comm) {
  // BEGIN SOLUTION: the naive version's means with ONE collective for all defined grads; each
  //   p.grad() keeps its shape (L06Flat.*; hints: README step 4)
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return;
  std::vector<torch::Tensor> flat_views;
  for (const auto& g : grads) flat_views.push_back(g.reshape({-1}));
  std::vector<at::Tensor> flat{torch::cat(flat_views)};  // (N,), N = total gradient elements
  comm.allreduce(flat)->wait();
  flat[0].div_(static_cast<double>(comm.getSize()));
  int64_t offset = 0;
  for (auto& g : grads) {
    g.copy_(flat[0].slice(0, offset, offset + g.numel()).view_as(g));
    offset += g.numel();
  }
  // END SOLUTION
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
  // BEGIN SOLUTION: ddp.h's buckets: the first one holds the LAST parameters, each is closed once
  //   its bytes reach bucket_bytes, no parameter is split (L06Buckets.*; hints: README step 5)
  std::vector<size_t> current;
  int64_t bytes = 0;
  for (size_t i = params.size(); i-- > 0;) {
    current.push_back(i);
    bytes += params[i].numel() * static_cast<int64_t>(params[i].element_size());
    if (bytes >= bucket_bytes) {
      buckets.push_back(std::move(current));
      current.clear();
      bytes = 0;
    }
  }
  if (!current.empty()) buckets.push_back(std::move(current));
  // END SOLUTION
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
  // BEGIN SOLUTION: parameter i needs one hook that calls on_grad(i, grad), its id kept for the
  //   destructor (L06Bucketed.*; hints: README step 5)
  for (size_t i = 0; i < n; ++i) {
    // A tensor hook on a leaf runs once per backward with the leaf's whole incoming gradient
    // (a weight used twice, like the tied wte, gets the sum of both uses), before autograd
    // adds it into p.grad().
    hook_ids_.push_back(
        params_[i].register_hook([this, i](const torch::Tensor& grad) { on_grad(i, grad); }));
  }
  // END SOLUTION
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
  // BEGIN SOLUTION: parameter i needs a slot (bucket_of_, offset_of_) in its bucket's flat zero
  //   buffer (the parameters' dtype and device), one buffer per bucket in flat_
  //   (L06Bucketed.*; hints: README step 5)
  for (size_t b = 0; b < buckets_.size(); ++b) {
    int64_t numel = 0;
    for (size_t i : buckets_[b]) {
      bucket_of_[i] = b;
      offset_of_[i] = numel;
      numel += params_[i].numel();
    }
    flat_.push_back(torch::zeros({numel}, params_[buckets_[b].front()].options()));
  }
  // END SOLUTION
}

void Reducer::on_grad(size_t index, const torch::Tensor& grad) {
  // BEGIN SOLUTION: under sync, p's slot holds what p.grad() is about to hold, and each bucket
  //   launches once complete, never before an earlier one; count them in launched_in_backward_
  //   (L06Bucketed.*, L06NoSync.*; hints: README step 5)
  if (!sync_) return;
  torch::NoGradGuard no_grad;
  const size_t b = bucket_of_[index];
  const auto& p = params_[index];
  auto slot = this->slot(index);
  if (p.grad().defined()) {
    torch::add_out(slot, p.grad(), grad);  // micro-steps accumulated under no_sync, plus this one
  } else {
    slot.copy_(grad);
  }
  if (!ready_[index]) {
    ready_[index] = true;
    --pending_[b];
  }
  while (next_to_launch_ < buckets_.size() && pending_[next_to_launch_] == 0) {
    launch(next_to_launch_++);
    ++launched_in_backward_;
  }
  // END SOLUTION
}

void Reducer::finish() {
  if (!sync_) return;
  // BEGIN SOLUTION: on return every p.grad() is the mean over ranks, also where no hook fired
  //   (that rank adds its p.grad() or zeros), and the next backward starts afresh; with a
  //   compression hook the hook has divided; a parameter that no rank used (unused()) keeps its
  //   p.grad() untouched (L06Bucketed.*, L06CommHook.*; hints: README step 5)
  torch::NoGradGuard no_grad;
  const std::vector<bool> unused_anywhere = unused();
  for (size_t b = next_to_launch_; b < buckets_.size(); ++b) {
    for (size_t i : buckets_[b]) {
      if (ready_[i]) continue;
      const auto& p = params_[i];
      auto slot = this->slot(i);
      if (p.grad().defined()) {
        slot.copy_(p.grad());
      } else {
        slot.zero_();
      }
    }
    launch(b);
  }
  const double world = comm_->getSize();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    work_[b]->wait();
    if (!compressed()) flat_[b].div_(world);  // a compression hook divided before its allreduce
    for (size_t i : buckets_[b]) {
      if (unused_anywhere[i]) continue;  // PyTorch: no rank used it, its grad stays as it was
      auto& p = params_[i];
      auto slot = this->slot(i);
      if (p.grad().defined()) {
        p.mutable_grad().copy_(slot);
      } else {
        p.mutable_grad() = slot.clone();
      }
    }
  }
  ready_.assign(params_.size(), false);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    pending_[b] = static_cast<int64_t>(buckets_[b].size());
    work_[b].reset();
  }
  next_to_launch_ = 0;
  // END SOLUTION
  if (rebuild_due()) rebuild_buckets();  // once, before the next forward
}

// ---------------------------------------------------------------------------------------------
// The distributed sampler
// ---------------------------------------------------------------------------------------------

int64_t DistributedSampler::num_samples() const {
  // BEGIN SOLUTION: PyTorch's per-rank count (ddp.h): equal on every rank, the remainder dropped
  //   with drop_last, padded up otherwise (L06Sampler.*; hints: README section 5)
  const int64_t w = num_replicas_;
  if (drop_last_ && size_ % w != 0) return (size_ - w + w - 1) / w;
  return (size_ + w - 1) / w;
  // END SOLUTION
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> mine;
  // BEGIN SOLUTION: exactly PyTorch's DistributedSampler indices for this rank and epoch: the
  //   ranks take disjoint positions of one order, num_samples() each (L06Sampler.*; hints:
  //   README section 5)
  std::vector<int64_t> order;
  if (shuffle_) {
    order = randperm(size_, seed_ + static_cast<uint64_t>(epoch_));
  } else {
    for (int64_t i = 0; i < size_; ++i) order.push_back(i);
  }
  const int64_t total = num_samples() * num_replicas_;
  if (drop_last_) {
    order.resize(static_cast<size_t>(total));
  } else {
    for (size_t i = 0; static_cast<int64_t>(order.size()) < total; ++i) {
      order.push_back(order[i]);  // i < the original size until the first pass is copied
    }
  }
  for (int64_t i = rank_; i < total; i += num_replicas_)
    mine.push_back(order[static_cast<size_t>(i)]);
  // END SOLUTION
  return mine;
}

// ---------------------------------------------------------------------------------------------
// Step 7: checkpoints, on rank 0 only
// ---------------------------------------------------------------------------------------------

void save_checkpoint(const std::string& path, int rank, torch::nn::Module& module,
                     torch::optim::Optimizer& optimizer, int64_t steps_done) {
  // BEGIN SOLUTION: rank 0 alone writes path, atomically (never half a file, no path.tmp left),
  //   with "model", "optimizer" and "steps_done" (L06Checkpoint.*; hints: README section 4)
  if (rank != 0) return;  // every replica is identical: one writer is enough
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive model_archive;
  module.save(model_archive);
  archive.write("model", model_archive);
  torch::serialize::OutputArchive optimizer_archive;
  optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("steps_done", torch::tensor(steps_done, torch::kLong));
  const std::string tmp = path + ".tmp";
  archive.save_to(tmp);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    throw std::runtime_error(fmt::format("cannot rename {} to {}", tmp, path));
  }
  // END SOLUTION
}

int64_t load_checkpoint(const std::string& path, torch::nn::Module& module,
                        torch::optim::Optimizer& optimizer) {
  // BEGIN SOLUTION: restore what save_checkpoint wrote and return steps_done: a resumed run equals
  //   the uninterrupted one bit for bit (L06Checkpoint.*; hints: README section 4)
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  torch::serialize::InputArchive model_archive;
  archive.read("model", model_archive);
  module.load(model_archive);
  torch::serialize::InputArchive optimizer_archive;
  archive.read("optimizer", optimizer_archive);
  optimizer.load(optimizer_archive);
  torch::Tensor steps_done;
  archive.read("steps_done", steps_done);
  return steps_done.item<int64_t>();
  // END SOLUTION
}

}  // namespace dtc::l06
