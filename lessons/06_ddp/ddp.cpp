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

void Reducer::on_grad(size_t index, const torch::Tensor& grad) {
  // TODO(L06)
  DTC_TODO("L06",
           "under sync, p's slot holds what p.grad() is about to hold, and each bucket "
           "launches once complete, never before an earlier one; count them in "
           "launched_in_backward_ "
           "(L06Bucketed.*, L06NoSync.*; hints: README step 5)");
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
// generated from solutions/06_ddp/ddp.cpp; checksum 932711e54b630f3f
